#!/usr/bin/env bash
# Optional extra for `quasar bench`: llama-cpp-python, so the llamacpp / llamacpp-pld peers
# (and their Q8_0 variants) can run. It builds llama.cpp from the package index's source
# distribution with cmake — on this 2-core machine that takes a long while (tens of minutes).
# Without it the benchmark still runs and reports those peers as unavailable.
#
# Usage: bash scripts/install_llamacpp.sh            (into .venv, after scripts/setup.sh)
#   LLAMA_CPP_PYTHON_VERSION=0.3.36  version to build (default below)
#   LLAMA_CPP_CMAKE_ARGS="..."       extra cmake flags, appended to the CPU defaults
#   JOBS=2                           parallel compile jobs (default: number of cores)
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-$(nproc)}

if [ ! -x .venv/bin/python ]; then
  echo "no .venv here: run scripts/setup.sh first" >&2
  exit 1
fi
. .venv/bin/activate

if python -c "import llama_cpp" 2>/dev/null; then
  echo "llama-cpp-python already installed: $(python -c 'import llama_cpp; print(llama_cpp.__version__)')"
  exit 0
fi

for tool in cmake g++; do
  if ! command -v "$tool" >/dev/null; then
    echo "$tool is needed to build llama.cpp (apt-get install cmake g++)" >&2
    exit 1
  fi
done

# CPU only: no CUDA/Metal/Vulkan; native instructions for this machine (AVX512/VNNI here);
# OpenMP threading like llama.cpp's own default; no examples, tests or server.
export CMAKE_ARGS="-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF ${LLAMA_CPP_CMAKE_ARGS:-}"
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
export FORCE_CMAKE=1

echo "building llama-cpp-python==$VERSION from source (CMAKE_ARGS=$CMAKE_ARGS, $JOBS jobs)"
pip install --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$VERSION"

python - <<'EOF'
import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: F401

assert hasattr(llama_cpp, "llama_model_quantize"), "this build lacks llama_model_quantize"
print(f"llama-cpp-python {llama_cpp.__version__} ready: quasar bench --peers llamacpp,llamacpp-pld,llamacpp-q8,llamacpp-pld-q8")
EOF
