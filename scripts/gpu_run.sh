#!/usr/bin/env bash
# Steps of a session on the GPU machine (an H200 with MLX's CUDA wheels staged
# by ../shared/device/mlx-cuda-prepare.sh and sourced), run from a copy of
# this checkout:
#   bash scripts/gpu_run.sh build         the extension with CUDA (sm_90), put
#                                         in moestream/ (no pip install there)
#   bash scripts/gpu_run.sh medium DIR    the medium bench model into DIR
#   bash scripts/gpu_run.sh tests ARGS    pytest -m device tests/test_device.py ARGS
#   bash scripts/gpu_run.sh llama         llama-bench's CUDA build (sm_90) from the
#                                         packed source in build/ (moestream bench
#                                         llama-cpp pack), with no MLX needed yet:
#                                         build/llama.cpp-cuda/bin/llama-bench
#   bash scripts/gpu_run.sh gguf DIR OUT Q  DIR's weights as GGUF (q4_0 or q4_1)
# Python runs this checkout's moestream (PYTHONPATH), on the image's python3.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step=${1:?build, medium, tests, llama or gguf}
shift
case "$step" in
  build)
    start=$(date +%s)
    mkdir -p build/cuda
    cmake -S csrc -B build/cuda -DMOESTREAM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_BUILD_TYPE=Release >build/cuda.log 2>&1 \
      || { tail -30 build/cuda.log; exit 1; }
    cmake --build build/cuda -j16 >>build/cuda.log 2>&1 || { grep -E "error" -A3 build/cuda.log | head -40; exit 1; }
    cp build/cuda/_native*.so moestream/
    python3 -c 'import mlx.core as mx; from moestream import _native as n; print("built in", end=" "); print(n.built_with_cuda(), mx.default_device())'
    echo "build took $(($(date +%s) - start)) s"
    ;;
  medium)
    out=${1:?DIR}
    /usr/bin/time -f "make-model medium: %e s, max RSS %M KB" \
      python3 -m moestream bench make-model medium "$out"
    ;;
  tests)
    python3 -m pytest -q -p no:cacheprovider -p no:xdist -m device tests/test_device.py "$@"
    ;;
  llama)
    # The flags of moestream/bench/llama_cpp.py's "cuda" variant and COMMON_FLAGS.
    start=$(date +%s)
    export PATH="/usr/local/cuda/bin:$PATH"
    src=/tmp/llama.cpp-src tree=/tmp/llama.cpp-cuda  # outside the synced tree
    if [ ! -f "$src/CMakeLists.txt" ]; then
      mkdir -p "$src" && tar -xzf build/llama.cpp-*-src.tar.gz -C "$src"
    fi
    cmake -S "$src" -B "$tree" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
      -DGGML_NATIVE=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 >build/llama-cuda.log 2>&1
    cmake --build "$tree" --target llama-bench -j "${JOBS:-12}" >>build/llama-cuda.log 2>&1
    mkdir -p build/llama.cpp-cuda/bin && cp "$tree/bin/llama-bench" build/llama.cpp-cuda/bin/
    echo "llama-bench (CUDA) built in $(($(date +%s) - start)) s"
    ;;
  gguf)
    python3 -m moestream bench llama-cpp gguf "${1:?DIR}" "${2:?OUT}" --quant "${3:-q4_0}"
    ;;
  *)
    echo "unknown step $step: build, medium, tests, llama or gguf" >&2
    exit 2
    ;;
esac
