#pragma once
/// \file pareto_plot.hpp
/// \brief Writes a bits-per-element versus quality scatter (one labelled point per policy, the
///        Pareto frontier joined) as a PNG with gnuplot: the data and script go next to the PNG,
///        so the figure can be redrawn or restyled by hand.

#include <fmt/core.h>
#include <fmt/os.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <string>
#include <vector>

namespace kvpack::inline v0::examples {

struct ParetoPoint {
  std::string label;
  double bits = 0.0;   ///< x: bits per element (lower is better)
  double error = 0.0;  ///< y: an error measure (lower is better), drawn on a log axis
};

/// Points no other point beats on both axes, by increasing bits.
inline std::vector<ParetoPoint> pareto_frontier(std::vector<ParetoPoint> points) {
  std::sort(points.begin(), points.end(), [](const ParetoPoint& a, const ParetoPoint& b) {
    return a.bits != b.bits ? a.bits < b.bits : a.error < b.error;
  });
  std::vector<ParetoPoint> frontier;
  for (const ParetoPoint& p : points) {
    if (frontier.empty() || p.error < frontier.back().error) frontier.push_back(p);
  }
  return frontier;
}

/// `text` inside a gnuplot single-quoted string: a quote is written twice.
inline std::string gnuplot_quoted(const std::string& text) {
  std::string out;
  for (const char c : text) {
    out += c;
    if (c == '\'') out += c;
  }
  return out;
}

/// Runs `gnuplot script` directly, not through a shell (a path is never a command); the exit
/// status, or -1 when gnuplot could not be started (`not_found` then says whether it is missing).
inline int run_gnuplot(const std::string& script, bool& not_found) {
  std::string program = "gnuplot", argument = script;
  char* argv[] = {program.data(), argument.data(), nullptr};
  pid_t pid = 0;
  const int error = ::posix_spawnp(&pid, "gnuplot", nullptr, nullptr, argv, environ);
  not_found = error == ENOENT;
  if (error != 0) return -1;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/// Writes `<png>.dat`, `<png>.gp` and, when gnuplot runs, `png`. Returns false (with the reason
/// in `why`) when the PNG could not be drawn.
inline bool write_pareto_plot(const std::string& png, const std::string& title, const std::string& y_label,
                              const std::vector<ParetoPoint>& points, std::string& why) {
  const std::string data = png + ".dat", script = png + ".gp";
  {
    auto out = fmt::output_file(data);
    out.print("# policy bits_per_element error\n");
    for (const ParetoPoint& p : points) {
      // Errors of exactly 0 (lossless) cannot sit on a log axis: plot them at a floor, labelled.
      out.print("\"{}\" {:.6g} {:.6g}\n", p.label, p.bits, std::max(p.error, 1e-9));
    }
    out.print("\n\n# frontier\n");
    for (const ParetoPoint& p : pareto_frontier(points)) out.print("\"{}\" {:.6g} {:.6g}\n", p.label, p.bits, std::max(p.error, 1e-9));
  }
  {
    auto out = fmt::output_file(script);
    out.print(
        "set terminal pngcairo size 900,600 enhanced font 'sans,11'\n"
        "set output '{}'\n"
        "set title \"{}\" noenhanced\n"
        "set xlabel 'bits per element (measured: every byte memory() reports)'\n"
        "set ylabel \"{}\" noenhanced\n"
        "set logscale y\nset format y '10^{{%L}}'\nset grid\nset key top right\n"
        "set offsets graph 0.05, graph 0.12, graph 0.1, graph 0.1\n"
        "plot '{}' index 1 using 2:3 with lines lw 2 lc rgb '#999999' title 'Pareto frontier', \\\n"
        "     '{}' index 0 using 2:3 with points pt 7 ps 1.5 lc rgb '#1f77b4' notitle, \\\n"
        "     '{}' index 0 using 2:3:1 with labels offset char 1,0.6 left font ',9' noenhanced notitle\n",
        gnuplot_quoted(png), title, y_label, gnuplot_quoted(data), gnuplot_quoted(data), gnuplot_quoted(data));
  }
  bool not_found = false;
  if (run_gnuplot(script, not_found) == 0) return true;
  why = not_found ? "gnuplot is not installed (cmake/install_deps.sh installs it); data and script are in " + data +
                        " and " + script
                  : "gnuplot failed on " + script;
  return false;
}

}  // namespace kvpack::inline v0::examples
