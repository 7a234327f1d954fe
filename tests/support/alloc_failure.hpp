#pragma once
// Allocation failure injection: the cache test executable replaces operator new
// (tests/unit/cache/alloc_failure_injection.cpp) with one that throws std::bad_alloc at the n-th
// allocation from now on the thread that set allocations_until_failure = n; at -1 (the default)
// it never fails. Aligned new, which the page pool's slabs use, is not replaced. ThreadSanitizer's
// runtime defines operator new itself (a replacement does not link): there the injection is off.

#if defined(__SANITIZE_THREAD__)
#define KVPACK_TEST_ALLOCATION_FAILURES 0
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVPACK_TEST_ALLOCATION_FAILURES 0
#endif
#endif
#ifndef KVPACK_TEST_ALLOCATION_FAILURES
#define KVPACK_TEST_ALLOCATION_FAILURES 1
#endif

namespace kvpack::test {

/// Whether operator new is replaced, i.e. allocations_until_failure has an effect.
inline constexpr bool kAllocationFailures = KVPACK_TEST_ALLOCATION_FAILURES != 0;

extern thread_local long allocations_until_failure;

}  // namespace kvpack::test
