#!/usr/bin/env bash
# Steps of a session on a GPU machine (an H200 with MLX's CUDA wheels installed
# and their environment sourced), run from a copy of this checkout:
#   bash scripts/gpu_run.sh build         the extension with CUDA (sm_90), put
#                                         in moestream/ (no pip install there)
#   bash scripts/gpu_run.sh medium DIR    the medium bench model into DIR
#   bash scripts/gpu_run.sh tests ARGS    pytest -m device tests/test_device.py ARGS
#   bash scripts/gpu_run.sh llama         llama-bench's CUDA build (sm_90) from the
#                                         packed source in build/ (moestream bench
#                                         llama-cpp pack), after MLX is staged:
#                                         build/llama.cpp-cuda/bin/llama-bench
#   bash scripts/gpu_run.sh gguf DIR OUT Q  DIR's weights as GGUF (q4_0 or q4_1)
#   bash scripts/gpu_run.sh train OUT     scripts/train_router.py (128 experts,
#                                         top-8) for MINUTES (default 6) on the
#                                         GPU: OUT/routing.npz
# Python runs this checkout's moestream (PYTHONPATH), on the image's python3.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step=${1:?build, medium, tests, llama, gguf or train}
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
    # `bench llama-cpp build --cuda` unpacks the packed source carried in build/.
    export PATH="/usr/local/cuda/bin:$PATH"
    python3 -m moestream bench llama-cpp build --cuda --jobs "${JOBS:-12}"
    ;;
  gguf)
    python3 -m moestream bench llama-cpp gguf "${1:?DIR}" "${2:?OUT}" --quant "${3:-q4_0}"
    ;;
  train)
    PYTHONUNBUFFERED=1 python3 scripts/train_router.py --minutes "${MINUTES:-6}" \
      --out "${1:?OUT}" --no-save-model
    ;;
  *)
    echo "unknown step $step: build, medium, tests, llama, gguf or train" >&2
    exit 2
    ;;
esac
