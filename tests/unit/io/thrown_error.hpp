#pragma once
// The kvpack::Error a call throws, so a test can check its exact code and message; any other
// exception propagates and fails the test.

#include <optional>

#include "kvpack/error.hpp"

namespace kvpack::test {

template <class Call>
std::optional<Error> thrown_error(Call&& call) {
  try {
    call();
  } catch (const Error& e) {
    return e;
  }
  return std::nullopt;
}

}  // namespace kvpack::test
