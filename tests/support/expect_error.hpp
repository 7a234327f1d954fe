#pragma once
// Checks that a call throws kvpack::Error with the expected code and words in its message.

#include <catch2/catch.hpp>

#include "kvpack/error.hpp"

namespace kvpack::test {

/// Runs `call`, which must throw kvpack::Error with `code` and a message containing `words`.
template <class Call>
void expect_error(Call call, ErrorCode code, const char* words) {
  try {
    call();
    FAIL("no error; expected one saying \"" << words << "\"");
  } catch (const Error& e) {
    CHECK(e.code() == code);
    CHECK_THAT(e.what(), Catch::Contains(words));
  }
}

}  // namespace kvpack::test
