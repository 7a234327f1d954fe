#pragma once
// Allocation failure injection: the cache test executable replaces operator new
// (tests/unit/cache/alloc_failure_injection.cpp) with one that throws std::bad_alloc at the n-th
// allocation from now on the thread that set allocations_until_failure = n; at -1 (the default)
// it never fails. Aligned new, which the page pool's slabs use, is not replaced.

namespace kvpack::test {

extern thread_local long allocations_until_failure;

}  // namespace kvpack::test
