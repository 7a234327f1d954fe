#pragma once
/// \file progress_bar.hpp
/// \brief A one-line progress bar on stderr for sweeps that take seconds. Drawn only when stderr
///        is a terminal, so logs and pipes stay clean.

#include <fmt/core.h>
#include <unistd.h>

#include <cstdio>
#include <string>

namespace kvpack::inline v0::examples {

class ProgressBar {
 public:
  ProgressBar(std::string label, int total)
      : label_(std::move(label)), total_(total), enabled_(isatty(fileno(stderr)) != 0 && total > 0) {}
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  ~ProgressBar() { finish(); }

  void update(int done) {
    if (!enabled_) return;
    constexpr int kWidth = 30;
    const int filled = done * kWidth / total_;
    fmt::print(stderr, "\r{:<28} [{:<{}}] {}/{}", label_, std::string(static_cast<std::size_t>(filled), '#'), kWidth,
               done, total_);
    std::fflush(stderr);
    drawn_ = true;
  }

  /// Clears the line, so the next output starts clean.
  void finish() {
    if (!drawn_) return;
    fmt::print(stderr, "\r{:<80}\r", "");
    std::fflush(stderr);
    drawn_ = false;
  }

 private:
  std::string label_;
  int total_;
  bool enabled_;
  bool drawn_ = false;
};

}  // namespace kvpack::inline v0::examples
