#!/usr/bin/env bash
# Optional extras for `quasar bench`:
#  - llama-cpp-python, so the llamacpp / llamacpp-pld peers (and their Q8_0 variants) can run;
#  - .venv/bin/llama-server, llama.cpp's own OpenAI server, built from the same source
#    distribution, for the serving protocol (`quasar bench --protocol serving`).
# Both are built from the package index's source distribution with cmake — on this 2-core
# machine that takes a long while (tens of minutes). Each part is skipped when already
# installed. Without them the benchmark still runs and reports those peers as unavailable.
#
# Usage: bash scripts/setup/install_llamacpp.sh            (into .venv, after scripts/setup/setup.sh)
#   LLAMA_CPP_PYTHON_VERSION=0.3.36  version to build (default below)
#   LLAMA_CPP_CMAKE_ARGS="..."       extra cmake flags, appended to the CPU defaults
#   JOBS=2                           parallel compile jobs (default: number of cores)
set -euo pipefail
cd "$(dirname "$0")/../.."

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-$(nproc)}
SERVER=.venv/bin/llama-server

if [ ! -x .venv/bin/python ]; then
  echo "no .venv here: run scripts/setup/setup.sh first" >&2
  exit 1
fi
. .venv/bin/activate

for tool in cmake g++; do
  if ! command -v "$tool" >/dev/null; then
    echo "$tool is needed to build llama.cpp (apt-get install cmake g++)" >&2
    exit 1
  fi
done

# CPU only: no CUDA/Metal/Vulkan; OpenMP threading like llama.cpp's own default; no
# examples or tests. Instruction sets are named from /proc/cpuinfo rather than
# -march=native (GGML_NATIVE): many VMs advertise AMX without enabling its tile state, and
# ggml's AMX path then dies with SIGILL on its first matrix multiply (seen on this machine),
# so AMX stays off and the AVX512 / VNNI kernels are used.
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
ISA="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) \
-DGGML_BMI2=$(has bmi2) -DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi) \
-DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
CPU_ARGS="-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON $ISA \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF"

install_python_binding() {
  if python -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python already installed: $(python -c 'import llama_cpp; print(llama_cpp.__version__)')"
    return
  fi
  export CMAKE_ARGS="$CPU_ARGS -DLLAMA_BUILD_SERVER=OFF ${LLAMA_CPP_CMAKE_ARGS:-}"
  export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
  export FORCE_CMAKE=1
  echo "building llama-cpp-python==$VERSION from source (CMAKE_ARGS=$CMAKE_ARGS, $JOBS jobs)"
  pip install --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$VERSION"

  python - <<'EOF'
import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: F401

assert hasattr(llama_cpp, "llama_model_quantize"), "this build lacks llama_model_quantize"

# A few tokens of the default model's own GGUF: a build for instructions this CPU cannot
# run fails here (SIGILL), not in the middle of a benchmark.
from quasar.data.packages import default_model_path

llm = llama_cpp.Llama(str(default_model_path()), n_ctx=64, n_threads=2, verbose=False)
assert llm("def add(a, b):", max_tokens=4)["choices"][0]["text"] is not None
print(f"llama-cpp-python {llama_cpp.__version__} ready: quasar bench --peers llamacpp,llamacpp-pld,llamacpp-q8,llamacpp-pld-q8")
EOF
}

server_ready() {
  [ -x "$SERVER" ] && "$SERVER" --help 2>/dev/null | grep -q -- "--spec-type"
}

# llama-server from the sdist's own vendor/llama.cpp, so the server peer runs exactly the
# llama.cpp the Python peers run. Linked statically (one file to install); no libcurl,
# OpenSSL or web UI download, so the build needs nothing beyond the package index.
install_server() {
  if server_ready; then
    echo "llama-server already installed: $SERVER"
    return
  fi
  local work=.venv/build/llama-server-$VERSION
  local src=$work/llama_cpp_python-$VERSION/vendor/llama.cpp
  mkdir -p "$work"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
    tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
  fi
  echo "building llama-server from llama-cpp-python==$VERSION's llama.cpp ($JOBS jobs)"
  # shellcheck disable=SC2086  # the flag lists are meant to split into words
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF $CPU_ARGS \
    -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    ${LLAMA_CPP_CMAKE_ARGS:-}
  cmake --build "$work/build" --config Release --target llama-server -j"$JOBS"
  install -m 755 "$work/build/bin/llama-server" "$SERVER"
  if ! server_ready; then
    echo "the built llama-server does not run or lacks --spec-type: see $work/build" >&2
    exit 1
  fi
  rm -rf "$work"
  rmdir .venv/build 2>/dev/null || true
  echo "llama-server ready: $SERVER (quasar bench --protocol serving)"
}

install_python_binding
install_server
