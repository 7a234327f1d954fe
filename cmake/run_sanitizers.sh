#!/usr/bin/env bash
# The sanitizer half of the README test command, run after the normal build's ctest:
#   1. build-asan/: clang, -O1 -gline-tables-only, AddressSanitizer (leaks included) + UBSan (no
#      recovery: the first report fails the run); the unit test modules core, paging, kernels,
#      cache and io, each run in full (logs in build-asan/test-<module>.log), and the libFuzzer
#      targets of tests/fuzz/, each from its seed corpus tests/fuzz/corpus/<name> (new inputs go
#      to build-asan/fuzz-corpus/<name>, crashes to build-asan/fuzz-artifacts/), in two chains,
#      one per core. First: the kernels module, fuzz_cache_ops (random operation sequences
#      against the reference model) for KVPACK_FUZZ_SECONDS (default 32), fuzz_prefix_ops
#      (prefix sharing against a twin without it). Second: the other modules, fuzz_kv_dump (the
#      K/V dump loader) for 10^6 runs (KVPACK_FUZZ_RUNS), fuzz_config (configs and shapes),
#      fuzz_codec_spans (K/V bit patterns through every codec; then again with each lower kernel
#      target the CPU runs forced by KVPACK_ISA), fuzz_page_file (any bytes through the page-file
#      reader) and fuzz_eviction_ops (operation sequences on evicting caches). The targets after
#      cache_ops and kv_dump run for KVPACK_FUZZ_SECONDS / 4 each. Each target's log is in
#      build-asan/fuzz-<name>.log (fuzz-codec_spans-<isa>.log for a forced target); its final
#      counts are printed.
#   2. build-tsan/: clang, -O1 -gline-tables-only, ThreadSanitizer; the "[threads]" tests (the
#      concurrency stress test, the executor, the pool, the prefix index and prefix sharing in the
#      cache), built alone as kvpack_test_threads.
# Not under sanitizers, for time (2 cores): the quant module (see below), the eval module (but for
# its dump loader), the examples and their tests, the benches, the compile-only and packaging
# checks; the normal build runs all of them.
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
# Line tables are all a sanitizer report needs (file:line per frame); full debug info made the
# ASan build 1.2-1.8 times slower (measured per translation unit). -O0 would build twice as fast
# but run the kernel tests 4.5 times slower (519 s against 116 s).
common=(-DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -gline-tables-only"
        -DKVPACK_BUILD_BENCH=OFF -DKVPACK_BUILD_EXAMPLES=OFF -DKVPACK_INSTALL=OFF -DKVPACK_ENABLE_CUDA=OFF)

# Ninja when installed (cmake/install_deps.sh installs it): it schedules the whole build across
# both cores, where make's per-target recursion left one idle for minutes (measured on the ASan
# build: 9 min 3 s against 11 min 31 s). A build directory another generator configured is
# started afresh, since CMake refuses to switch generators in place.
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
# Configures build directory $1 with the remaining arguments.
configure() {
  local dir=$1
  shift
  if [[ -f "$dir/CMakeCache.txt" ]]; then
    local wanted="${generator[1]:-Unix Makefiles}"
    grep -qx "CMAKE_GENERATOR:INTERNAL=$wanted" "$dir/CMakeCache.txt" || rm -rf "$dir"
  fi
  cmake -S . -B "$dir" "${generator[@]}" "$@"
}

# Runs one test binary with its arguments, timing it.
run() {
  local start=$SECONDS
  echo "run_sanitizers: $*"
  "$@" || return  # explicit: callers in a || list turn off errexit
  echo "run_sanitizers: $1 passed in $((SECONDS - start)) s"
}

if [[ "$which_builds" != tsan ]]; then
  # Not quant: its codecs run under ASan through the cache module and fuzz_codec_spans (any bit
  # pattern through every codec); its 13 files would add a minute to the build.
  modules=(core paging kernels cache io)
  configure build-asan "${common[@]}" -DKVPACK_SANITIZE=address,undefined -DKVPACK_BUILD_FUZZERS=ON
  fuzzers=(cache_ops eviction_ops prefix_ops kv_dump config codec_spans page_file)
  cmake --build build-asan -j"$jobs" --target "${modules[@]/#/kvpack_test_}" "${fuzzers[@]/#/kvpack_fuzz_}"
  export ASAN_OPTIONS="detect_leaks=1:detect_stack_use_after_return=1:strict_init_order=1:check_initialization_order=1"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
  # Runs each test module named, in full; its log is build-asan/test-<module>.log.
  run_modules() {
    local module
    for module in "$@"; do
      run "build-asan/tests/kvpack_test_$module" >"build-asan/test-$module.log" 2>&1 ||
        { tail -n 80 "build-asan/test-$module.log"; echo "run_sanitizers: kvpack_test_$module FAILED"; return 1; }
      grep -E '^(All tests passed|run_sanitizers:)' "build-asan/test-$module.log"
    done
  }
  # Runs fuzz target $1 with libFuzzer's limits $2...; its output goes to build-asan/fuzz-$1.log,
  # and only the final counts (or, on failure, the end of the log) to this script's output. With
  # KVPACK_ISA set (the precompiled kernels it forces), the log's and the counts' names carry it.
  fuzz() {
    local name=$1 start=$SECONDS status=0
    local label=fuzz_$1${KVPACK_ISA:+_$KVPACK_ISA} log=build-asan/fuzz-$1${KVPACK_ISA:+-$KVPACK_ISA}.log
    shift
    mkdir -p "build-asan/fuzz-corpus/$name" build-asan/fuzz-artifacts
    "build-asan/tests/fuzz/kvpack_fuzz_$name" "$@" -print_final_stats=1 -artifact_prefix=build-asan/fuzz-artifacts/ \
      "build-asan/fuzz-corpus/$name" "tests/fuzz/corpus/$name" >"$log" 2>&1 || status=$?
    if ((status != 0)); then
      tail -n 60 "$log"
      echo "run_sanitizers: $label FAILED (log: $log)"
      return "$status"
    fi
    grep -E '^(Done|stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb))' "$log" |
      sed "s/^/$label: /"
    echo "run_sanitizers: $label passed in $((SECONDS - start)) s"
  }
  # Whether /proc/cpuinfo lists every flag named.
  cpu_has() {
    local flags flag
    flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    for flag; do [[ "$flags" == *" $flag "* ]] || return 1; done
  }
  # The kernel targets below this CPU's best that it can run (as kernels/cpu/isa.hpp's
  # cpu_supports decides from cpuid), best first.
  lower_isas() {
    local isas=()
    if cpu_has avx512f avx512bw avx512dq avx512vl avx512cd avx512_vnni avx2 fma f16c; then isas+=(avx512); fi
    if cpu_has avx2 fma f16c; then isas+=(avx2); fi
    isas+=(sse2)
    echo "${isas[@]:1}"
  }
  # Runs fuzz_codec_spans with each lower target's precompiled kernels forced, $1 seconds each.
  fuzz_codec_spans_lower_isas() {
    local isa
    for isa in $(lower_isas); do
      KVPACK_ISA=$isa fuzz codec_spans -max_total_time="$1" || return
    done
  }
  seconds="${KVPACK_FUZZ_SECONDS:-32}"
  # Two chains of about three minutes, one per core: the kernels module (~110 s) and two fuzzers;
  # the other modules (~55 s) and five fuzzers, codec_spans once per kernel target.
  { run_modules kernels && fuzz cache_ops -max_total_time="$seconds" &&
      fuzz prefix_ops -max_total_time=$((seconds / 4)); } &
  first_chain=$!
  # A failure stops a chain but still waits for the other, so that no fuzzer outlives the script.
  status=0
  # fuzz_kv_dump allocates and frees a file buffer per run: a small quarantine keeps those pages
  # hot (1.7 times the runs per second; use-after-free is still caught within 8 MB of frees).
  run_modules core paging cache io &&
    ASAN_OPTIONS="$ASAN_OPTIONS:quarantine_size_mb=8" fuzz kv_dump -runs="${KVPACK_FUZZ_RUNS:-1000000}" &&
    fuzz config -max_total_time=$((seconds / 4)) &&
    fuzz codec_spans -max_total_time=$((seconds / 4)) &&
    fuzz_codec_spans_lower_isas $((seconds / 4)) &&
    fuzz page_file -max_total_time=$((seconds / 4)) &&
    fuzz eviction_ops -max_total_time=$((seconds / 4)) || status=$?
  wait "$first_chain" || status=$?
  ((status == 0)) || exit "$status"
fi

if [[ "$which_builds" != asan ]]; then
  configure build-tsan "${common[@]}" -DKVPACK_SANITIZE=thread
  cmake --build build-tsan -j"$jobs" --target kvpack_test_threads
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"
  run build-tsan/tests/kvpack_test_threads "[threads]"
fi
echo "run_sanitizers: all passed"
