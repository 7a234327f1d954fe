// The positions a device cache keeps per layer (kernels/cuda/position_runs.hpp), host-clean:
// runs of consecutive positions that expand to exactly the positions added, in order.

#include <catch2/catch.hpp>

#include <cstdint>
#include <random>
#include <vector>

#include "kvpack/kernels/cuda/position_runs.hpp"

using kvpack::kernels::cuda::PositionRuns;

TEST_CASE("position runs merge consecutive positions and keep gaps", "[cuda_plan]") {
  PositionRuns runs;
  CHECK(runs.last() == -1);
  CHECK(runs.expand().empty());
  runs.add(0, 5);  // a prefill
  runs.add(5, 1);  // decode steps
  runs.add(6, 1);
  CHECK(runs.runs() == 1);
  runs.add(10, 2);  // a gap
  runs.add(12, 0);  // nothing
  runs.add(13, -3);
  CHECK(runs.runs() == 2);
  CHECK(runs.last() == 11);
  CHECK(runs.size() == 9);
  CHECK(runs.expand() == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 6, 10, 11});
  CHECK(runs.counted_from_zero() == 7);  // the gap ends what a prefix cache may share
  PositionRuns late;
  late.add(1, 8);
  CHECK(late.counted_from_zero() == 0);
  CHECK(PositionRuns{}.counted_from_zero() == 0);
}

TEST_CASE("position runs expand to every position added, against a model", "[cuda_plan]") {
  std::mt19937 rng(4400);
  for (const std::int64_t first : {std::int64_t{0}, static_cast<std::int64_t>(1 + rng() % 7)}) {
    PositionRuns runs;
    std::vector<std::int32_t> model;
    std::int64_t next = first;
    for (int step = 0; step < 2000; ++step) {
      const std::int64_t count = rng() % 4 == 0 ? static_cast<std::int64_t>(rng() % 40) : 1;
      runs.reserve();
      runs.add(next, count);
      for (std::int64_t i = 0; i < count; ++i) model.push_back(static_cast<std::int32_t>(next + i));
      if (count > 0) next += count;
      next += rng() % 5 == 0 ? static_cast<std::int64_t>(1 + rng() % 9) : 0;  // sometimes a gap
      REQUIRE(runs.last() == (model.empty() ? -1 : model.back()));
    }
    CHECK(runs.size() == static_cast<std::int64_t>(model.size()));
    CHECK(runs.expand() == model);
    CHECK(runs.runs() < model.size() / 4);  // runs, not one entry per position
    std::int64_t from_zero = 0;
    while (from_zero < static_cast<std::int64_t>(model.size()) && model[from_zero] == from_zero) ++from_zero;
    CHECK(runs.counted_from_zero() == from_zero);
    if (first == 0) CHECK(from_zero > 0);
  }
}
