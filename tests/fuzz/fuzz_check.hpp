// FUZZ_CHECK for the libFuzzer targets: a failed invariant prints where it failed and aborts, so
// that libFuzzer saves the input as a crash artifact (an exception would be just another input).
#pragma once

#include <cstdio>
#include <cstdlib>

namespace kvpack::fuzz {

[[noreturn]] inline void check_failed(const char* file, int line, const char* condition) {
  std::fprintf(stderr, "%s:%d: fuzz check failed: %s\n", file, line, condition);
  std::abort();
}

}  // namespace kvpack::fuzz

#define FUZZ_CHECK(cond)                                                   \
  do {                                                                     \
    if (!(cond)) ::kvpack::fuzz::check_failed(__FILE__, __LINE__, #cond);  \
  } while (false)
