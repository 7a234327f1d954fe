#!/usr/bin/env bash
# The sanitizer half of the README test command, run after the normal build's ctest:
#   1. build-asan/: clang, -O1 -g, AddressSanitizer (leaks included) + UBSan (no recovery: the
#      first report fails the run); the unit test modules core, paging, quant, kernels and cache,
#      each run in full.
#      Then the libFuzzer target tests/fuzz/fuzz_cache_ops.cpp (random operation sequences against
#      the reference model) for KVPACK_FUZZ_SECONDS (default 60) from its seed corpus; new inputs
#      go to build-asan/fuzz-corpus, crashes to build-asan/fuzz-artifacts.
#   2. build-tsan/: clang, -O1 -g, ThreadSanitizer; the "[threads]" tests of kvpack_test_cache
#      (the concurrency stress test and the executor) and of kvpack_test_paging.
# Not under sanitizers, for time (2 cores): the eval module, the examples and their tests, the
# benches, the compile-only and packaging checks; the normal build runs all of them.
#
#   cmake/run_sanitizers.sh            both
#   cmake/run_sanitizers.sh asan|tsan  one of them
# KVPACK_SANITIZER_CXX (default clang++-14) and KVPACK_SANITIZER_JOBS (default 2) override.
set -euo pipefail
cd "$(dirname "$0")/.."

which_builds="${1:-all}"
case "$which_builds" in
  all | asan | tsan) ;;
  *) echo "run_sanitizers: unknown argument '$which_builds' (all, asan or tsan)" >&2; exit 2 ;;
esac
cxx="${KVPACK_SANITIZER_CXX:-clang++-14}"
jobs="${KVPACK_SANITIZER_JOBS:-2}"
common=(-DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g"
        -DKVPACK_BUILD_BENCH=OFF -DKVPACK_BUILD_EXAMPLES=OFF -DKVPACK_INSTALL=OFF -DKVPACK_ENABLE_CUDA=OFF)

# Runs one test binary with its arguments, timing it.
run() {
  local start=$SECONDS
  echo "run_sanitizers: $*"
  "$@"
  echo "run_sanitizers: $1 passed in $((SECONDS - start)) s"
}

if [[ "$which_builds" != tsan ]]; then
  modules=(core paging quant kernels cache)
  cmake -S . -B build-asan "${common[@]}" -DKVPACK_SANITIZE=address,undefined -DKVPACK_BUILD_FUZZERS=ON
  cmake --build build-asan -j"$jobs" --target "${modules[@]/#/kvpack_test_}" kvpack_fuzz_cache_ops
  export ASAN_OPTIONS="detect_leaks=1:detect_stack_use_after_return=1:strict_init_order=1:check_initialization_order=1"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
  for module in "${modules[@]}"; do
    run "build-asan/tests/kvpack_test_$module"
  done
  mkdir -p build-asan/fuzz-corpus build-asan/fuzz-artifacts
  run build-asan/tests/fuzz/kvpack_fuzz_cache_ops -max_total_time="${KVPACK_FUZZ_SECONDS:-60}" -print_final_stats=1 \
    -artifact_prefix=build-asan/fuzz-artifacts/ build-asan/fuzz-corpus tests/fuzz/corpus/cache_ops
fi

if [[ "$which_builds" != asan ]]; then
  cmake -S . -B build-tsan "${common[@]}" -DKVPACK_SANITIZE=thread
  cmake --build build-tsan -j"$jobs" --target kvpack_test_cache kvpack_test_paging
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"
  run build-tsan/tests/kvpack_test_cache "[threads]"
  run build-tsan/tests/kvpack_test_paging "[threads]"
fi
echo "run_sanitizers: all passed"
