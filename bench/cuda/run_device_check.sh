#!/usr/bin/env bash
# The CUDA backend's device check, for a machine with a GPU: the CUDA kernel tests against the
# scalar reference, the CUDA-free API's tests (a host-compiled program through kvpack::cuda), then the decode-attention benchmark (Llama-3.1-8B attention shape, 32K x 4
# and 128K x 1, every device codec), with the achieved HBM bandwidth. About 2 minutes on an H200.
#
#   bench/cuda/run_device_check.sh [DIR]
#
# DIR holds kvpack_test_cuda, kvpack_test_cuda_api and kvpack_bench_cuda (and any shared library they need, such as
# Google Benchmark's); when it does not, they are built into DIR first, which needs the
# project's dependencies (cmake/install_deps.sh) and nvcc. Results go to $OUT when it is set
# (the device tool's output folder), else to DIR.
set -uo pipefail
cd "$(dirname "$0")/../.."
dir="${1:-build-cuda}"
results="${OUT:-$dir}"
mkdir -p "$dir" "$results"

if [[ ! -x "$dir/kvpack_test_cuda" || ! -x "$dir/kvpack_test_cuda_api" || ! -x "$dir/kvpack_bench_cuda" ]]; then
  cmake -S . -B "$dir/build" -DKVPACK_BUILD_EXAMPLES=OFF -DKVPACK_INSTALL=OFF &&
    cmake --build "$dir/build" --target kvpack_test_cuda kvpack_test_cuda_api kvpack_bench_cuda -j"$(nproc)" || exit 1
  cp "$dir/build/tests/cuda/kvpack_test_cuda" "$dir/build/tests/cuda/kvpack_test_cuda_api" \
    "$dir/build/bench/cuda/kvpack_bench_cuda" "$dir/"
fi
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.memory --format=csv |
  tee "$results/gpu.txt"

status=0
echo "== CUDA kernel tests"
"$dir/kvpack_test_cuda" --durations yes 2>&1 | tee "$results/test_cuda.txt"
test_status=${PIPESTATUS[0]}
[[ $test_status == 0 ]] || status=$test_status

echo "== The CUDA-free API from host-compiled code"
"$dir/kvpack_test_cuda_api" --durations yes 2>&1 | tee "$results/test_cuda_api.txt"
api_status=${PIPESTATUS[0]}
[[ $api_status == 0 ]] || status=$api_status

echo "== CUDA decode-attention benchmark"
"$dir/kvpack_bench_cuda" --benchmark_out="$results/bench_cuda.json" --benchmark_out_format=json \
  --benchmark_counters_tabular=true 2>&1 | tee "$results/bench_cuda.txt"
bench_status=${PIPESTATUS[0]}
[[ $bench_status == 0 ]] || status=$bench_status
exit "$status"
