#pragma once
/// \file cli.hpp
/// \brief Command-line reading shared by the examples: `--opt VALUE` and `--opt=VALUE`, numbers
///        checked against a range or a sign, comma lists; every mistake is a UsageError naming
///        the option.

#include <fmt/core.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <exception>
#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvpack::inline v0::examples {

/// Exit status of a command-line mistake.
constexpr int kUsageError = 2;

/// A command-line mistake; main prints it with the usage and exits with kUsageError.
struct UsageError {
  std::string message;
};

/// A decimal integer in [low, high], or a UsageError naming the option and the bad text.
template <class Int>
Int parse_number(std::string_view option, std::string_view text, Int low, Int high) {
  Int value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc{} || end != text.data() + text.size() || value < low || value > high) {
    throw UsageError{fmt::format("{} expects an integer in [{}, {}], got '{}'", option, low, high, text)};
  }
  return value;
}

/// A decimal integer > 0, or a UsageError naming the option and the bad text. For options with
/// no upper limit but the type's: the message states the rule, not the type's maximum.
template <class Int>
Int parse_positive(std::string_view option, std::string_view text) {
  Int value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error == std::errc::result_out_of_range) {
    throw UsageError{fmt::format("{} '{}' is out of range", option, text)};
  }
  if (error != std::errc{} || end != text.data() + text.size() || value <= 0) {
    throw UsageError{fmt::format("{} expects a positive integer, got '{}'", option, text)};
  }
  return value;
}

/// Whether zero is an acceptable value for parse_real (a latency may be 0, a bandwidth not).
enum class RealBound { kPositive, kNonNegative };

/// A finite decimal number, > 0 or >= 0 as `bound` says, or a UsageError naming the option and
/// the bad text. "inf" and "nan" parse as doubles; the finiteness check is what rejects them.
inline double parse_real(std::string_view option, std::string_view text, RealBound bound) {
  double value = 0.0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  const bool zero_ok = bound == RealBound::kNonNegative;
  if (error != std::errc{} || end != text.data() + text.size() || !std::isfinite(value) ||
      value < 0.0 || (!zero_ok && value == 0.0)) {
    throw UsageError{fmt::format("{} expects {}, got '{}'", option,
                                 zero_ok ? "a number >= 0" : "a positive number", text)};
  }
  return value;
}

/// parse_real's number, also within [low, high] (rates whose quotients must stay finite).
inline double parse_real_in(std::string_view option, std::string_view text, double low, double high) {
  const double value = parse_real(option, text, low > 0.0 ? RealBound::kPositive : RealBound::kNonNegative);
  if (value < low || value > high) {
    throw UsageError{fmt::format("{} expects a number in [{:g}, {:g}], got '{}'", option, low, high, text)};
  }
  return value;
}

/// `text` split at `separator`, empty items rejected.
inline std::vector<std::string> split(std::string_view text, char separator) {
  std::vector<std::string> items;
  std::size_t start = 0;
  while (true) {
    const std::size_t end = text.find(separator, start);
    const std::string_view item = text.substr(start, end == std::string_view::npos ? end : end - start);
    if (item.empty()) throw UsageError{fmt::format("empty item in the list '{}'", text)};
    items.emplace_back(item);
    if (end == std::string_view::npos) return items;
    start = end + 1;
  }
}

/// The body of an example's main(): `run(parse())`, with a UsageError printed as
/// "program: message" plus the usage (exit kUsageError) and any other exception as
/// "program: what" (exit 1).
template <class Parse, class Run, class PrintUsage>
int guarded_main(std::string_view program, Parse parse, Run run, PrintUsage print_usage) {
  try {
    return run(parse());
  } catch (const UsageError& e) {
    fmt::print(stderr, "{}: {}\n", program, e.message);
    print_usage(stderr);
    return kUsageError;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: {}\n", program, e.what());
    return 1;
  }
}

/// Walks argv one option at a time: `while (args.next()) { if (args.is("--x")) ... }`. An
/// option given twice is a UsageError (no example takes one twice: the last value winning
/// silently hides a typo), as is an empty value ("--json=" from an unset shell variable).
class ArgReader {
 public:
  ArgReader(int argc, char** argv) : argc_(argc), argv_(argv) {}

  /// Moves to the next option; false at the end. An `=VALUE` the previous option did not read
  /// is a UsageError, which is how a flag such as `--list=yes` is rejected.
  bool next() {
    if (inline_value_) throw UsageError{fmt::format("{} takes no value", name_)};
    if (index_ + 1 >= argc_) return false;
    std::string_view arg = argv_[++index_];
    inline_value_.reset();
    if (const auto eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      inline_value_ = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    name_ = arg;
    if (std::find(seen_.begin(), seen_.end(), name_) != seen_.end()) {
      throw UsageError{fmt::format("{} given more than once", name_)};
    }
    seen_.push_back(name_);
    return true;
  }

  [[nodiscard]] std::string_view name() const noexcept { return name_; }
  [[nodiscard]] bool is(std::string_view option) const noexcept { return name_ == option; }

  /// The current option's value (the `=` part or the next argument), never empty.
  std::string_view value() {
    std::string_view v;
    if (inline_value_) {
      v = *inline_value_;
      inline_value_.reset();
    } else if (index_ + 1 < argc_ && !std::string_view(argv_[index_ + 1]).starts_with("--")) {
      // "--model --context 10" is a forgotten value, not a model called "--context".
      v = argv_[++index_];
    }
    if (v.empty()) throw UsageError{fmt::format("{} needs a value", name_)};
    return v;
  }

  template <class Int>
  Int number(Int low, Int high) {
    return parse_number<Int>(name_, value(), low, high);
  }

  template <class Int>
  Int positive() {
    return parse_positive<Int>(name_, value());
  }

  double real(RealBound bound) { return parse_real(name_, value(), bound); }
  double real_in(double low, double high) { return parse_real_in(name_, value(), low, high); }

 private:
  int argc_;
  char** argv_;
  int index_ = 0;
  std::string_view name_;
  std::optional<std::string_view> inline_value_;
  std::vector<std::string_view> seen_;
};

}  // namespace kvpack::inline v0::examples
