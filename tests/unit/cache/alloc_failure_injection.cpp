// The replaceable allocation functions of the cache test executable: malloc and free, with the
// failure injection of support/alloc_failure.hpp. In a file of their own, so that no caller sees
// (and GCC 12 does not inline and flag) their bodies.

#include <cstdlib>
#include <new>

#include "support/alloc_failure.hpp"

namespace kvpack::test {
thread_local long allocations_until_failure = -1;
}  // namespace kvpack::test

#if KVPACK_TEST_ALLOCATION_FAILURES
void* operator new(std::size_t bytes) {
  long& countdown = kvpack::test::allocations_until_failure;
  if (countdown >= 0 && countdown-- == 0) throw std::bad_alloc();
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t bytes) { return ::operator new(bytes); }
// Every other non-aligned form too: a sanitizer runtime provides its own, and its nothrow new
// freed by the delete below would be a mismatch.
void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(bytes);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t bytes, const std::nothrow_t& tag) noexcept { return ::operator new(bytes, tag); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
#endif
