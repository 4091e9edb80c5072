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

# CPU only: no CUDA/Metal/Vulkan; OpenMP threading like llama.cpp's own default; no
# examples, tests or server. Instruction sets are named from /proc/cpuinfo rather than
# -march=native (GGML_NATIVE): many VMs advertise AMX without enabling its tile state, and
# ggml's AMX path then dies with SIGILL on its first matrix multiply (seen on this machine),
# so AMX stays off and the AVX512 / VNNI kernels are used.
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
ISA="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) \
-DGGML_BMI2=$(has bmi2) -DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi) \
-DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
export CMAKE_ARGS="-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON $ISA \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF ${LLAMA_CPP_CMAKE_ARGS:-}"
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
