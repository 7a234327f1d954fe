#pragma once
/// \file error.hpp
/// \brief kvpack::Error, its codes, and the KVPACK_CHECK macro used by every host-side check.

#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#include "kvpack/config.hpp"

namespace kvpack::inline v0 {

/// What went wrong, so callers can react without parsing messages.
enum class ErrorCode {
  kInvalidArgument,   ///< a value or shape the call cannot accept
  kInvalidConfig,     ///< a ModelShape / CacheConfig / policy option that is inconsistent
  kNonFinite,         ///< NaN or Inf in K/V/Q input while finite checks are on
  kOutOfRange,        ///< a value the codec cannot represent (e.g. beyond the fp16 scale range)
  kUnknownSequence,   ///< a SeqId that was never issued or was released
  kOutOfPages,        ///< the page pool has no free page left
  kUnsupported,       ///< a feature or value this build or codec does not support
  kUnavailable,       ///< a storage tier could not be reached, read or written (kvpack/tier/)
};

/// The one exception type kvpack throws. A failed call leaves the cache as it was.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  [[nodiscard]] ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

/// Thrown when the page pool is exhausted; a distinct type so engines can catch it to preempt.
class OutOfPages : public Error {
 public:
  explicit OutOfPages(const std::string& message) : Error(ErrorCode::kOutOfPages, message) {}
};

namespace detail {

inline void append_text(std::string& out, std::string_view piece) { out += piece; }
inline void append_text(std::string& out, const char* piece) { out += piece; }
inline void append_text(std::string& out, const std::string& piece) { out += piece; }
inline void append_text(std::string& out, char piece) { out += piece; }
template <class Number>
  requires std::is_arithmetic_v<Number>
void append_text(std::string& out, Number value) {
  out += std::to_string(value);
}

/// Builds an error message from strings and numbers without pulling <sstream> or fmt into the core.
template <class... Pieces>
std::string message(const Pieces&... pieces) {
  std::string out;
  (append_text(out, pieces), ...);
  return out;
}

// The builtins (not std::source_location) because clang 14 with libstdc++ 12 lacks the latter;
// as default arguments they report the caller's location.
[[noreturn]] inline void throw_error(ErrorCode code, std::string_view message,
                                     const char* function = __builtin_FUNCTION(),
                                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  std::string text{message};
  text += " [";
  text += function;
  text += " at ";
  text += file;
  text += ':';
  text += std::to_string(line);
  text += ']';
  if (code == ErrorCode::kOutOfPages) throw OutOfPages(text);
  throw Error(code, text);
}

}  // namespace detail
}  // namespace kvpack::inline v0

/// Throws kvpack::Error(code, message) with the calling function, file and line when `cond` is false.
/// `message` is any expression convertible to std::string_view; it is evaluated only on failure.
#define KVPACK_CHECK(cond, code, message)                                    \
  do {                                                                       \
    if (!(cond)) [[unlikely]] {                                              \
      ::kvpack::detail::throw_error(::kvpack::ErrorCode::code, (message));   \
    }                                                                        \
  } while (false)
