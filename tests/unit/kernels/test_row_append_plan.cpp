// The device layer's append plan (kernels/cuda/row_append_plan.hpp), run on host memory with the
// codecs' scalar encoders, against a KVCache fed the same tokens: after every append the pages
// must hold the cache's bytes and the fp32 rows the cache's exact prefix and tail, for rules with
// and without an exact prefix and a tail window, appends of one token up to several pages, and
// two streams interleaved in the input as a layer's tokens arrive ([tokens][streams][head_dim]).
// No copy of the plan may overlap itself: the device runs each as one cudaMemcpy2DAsync.

#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

#include "kvpack/kernels/cuda/row_append_plan.hpp"
#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;
using kernels::cuda::RowAppendPlan;
using kernels::cuda::RowBuffer;
using kernels::cuda::RowRule;
using kernels::cuda::RowStep;
using kernels::cuda::StoredRows;

/// One stream's device state, in host memory: fp32 rows, a page of scratch, the encoded pages.
struct HostStream {
  std::vector<float> keys, values;  // stored rows, grown as the plan needs
  std::vector<float> scratch_keys, scratch_values;
  std::vector<std::vector<std::byte>> pages;
  StoredRows rows;
};

template <class Quantizer>
class PlanRunner {
 public:
  PlanRunner(const Quantizer& quantizer, RowRule rule, index_t head_dim, std::size_t payload_bytes,
             std::size_t value_offset)
      : q_(quantizer), rule_(rule), d_(head_dim), payload_bytes_(payload_bytes), value_offset_(value_offset) {}

  /// Appends `count` rows of stream `s` from `keys`/`values`, whose rows are `stride` floats apart.
  template <class Params>
  void append(HostStream& stream, const float* keys, const float* values, std::ptrdiff_t stride, index_t count,
              const Params& params) {
    const RowAppendPlan plan = kernels::cuda::plan_row_append(stream.rows, count, rule_);
    const std::size_t needed = static_cast<std::size_t>(plan.stored_rows_needed) * d_;
    if (stream.keys.size() < needed) {
      stream.keys.resize(needed, std::nanf(""));
      stream.values.resize(needed, std::nanf(""));
    }
    stream.scratch_keys.resize(static_cast<std::size_t>(rule_.page_size) * d_, std::nanf(""));
    stream.scratch_values.resize(stream.scratch_keys.size(), std::nanf(""));
    auto rows_of = [&](RowBuffer b, bool key) -> std::pair<float*, std::ptrdiff_t> {
      switch (b) {
        case RowBuffer::kStored: return {(key ? stream.keys : stream.values).data(), d_};
        case RowBuffer::kScratch: return {(key ? stream.scratch_keys : stream.scratch_values).data(), d_};
        case RowBuffer::kInput: return {const_cast<float*>(key ? keys : values), stride};
      }
      return {nullptr, 0};
    };
    const quant::PageGeometry g{rule_.page_size, d_};
    for (const RowStep& step : plan.steps) {
      REQUIRE(step.count > 0);
      if (step.kind == RowStep::Kind::kCopy) {
        REQUIRE(step.to != RowBuffer::kInput);
        if (step.from == step.to) {  // one cudaMemcpy2DAsync: source and target must not overlap
          REQUIRE((step.from_row + step.count <= step.to_row || step.to_row + step.count <= step.from_row));
        }
        for (bool key : {true, false}) {
          const auto [src, src_stride] = rows_of(step.from, key);
          const auto [dst, dst_stride] = rows_of(step.to, key);
          for (index_t r = 0; r < step.count; ++r) {
            std::memcpy(dst + (step.to_row + r) * dst_stride, src + (step.from_row + r) * src_stride,
                        static_cast<std::size_t>(d_) * sizeof(float));
          }
        }
      } else {
        const auto [keys_src, key_stride] = rows_of(step.from, true);
        const auto [values_src, value_stride] = rows_of(step.from, false);
        for (index_t p = 0; p < step.count; ++p) {
          std::vector<std::byte> page(payload_bytes_, std::byte{0});
          const index_t first = step.from_row + p * rule_.page_size;
          q_.key.encode(g, keys_src + first * key_stride, key_stride, params.first, page.data());
          q_.value.encode(g, values_src + first * value_stride, value_stride, params.second,
                          page.data() + value_offset_);
          stream.pages.push_back(std::move(page));
        }
      }
    }
    stream.rows = plan.after;
  }

 private:
  Quantizer q_;
  RowRule rule_;
  index_t d_;
  std::size_t payload_bytes_, value_offset_;
};

template <class Quantizer>
void check_plan_against_cache(RowRule rule, index_t head_dim, std::uint32_t seed) {
  constexpr index_t kStreams = 2;
  const ModelShape shape{1, kStreams, kStreams, head_dim};
  CacheConfig config;
  config.page_size = rule.page_size;
  config.exact_prefix_tokens = rule.window.exact_prefix_tokens;
  config.tail_tokens = rule.window.tail_tokens;
  KVCache<layout::GQA, Quantizer> cache(shape, config);
  const SeqId seq = cache.add_sequence();
  const auto info = cache.page_format_info();
  PlanRunner<Quantizer> runner(cache.quantizer(), rule, head_dim, info.payload_bytes, cache.value_plane_offset());
  std::vector<HostStream> streams(kStreams);

  std::mt19937 rng(seed);
  const index_t sizes[] = {1, 1, 1, 2, 5, rule.page_size - 1, rule.page_size, rule.page_size + 1,
                           3 * rule.page_size + 7, 1, 1};
  std::uniform_int_distribution<std::size_t> pick(0, std::size(sizes) - 1);
  index_t written = 0;
  for (int call = 0; call < 40; ++call) {
    const index_t count = call == 0 ? 2 : sizes[pick(rng)];
    const std::size_t floats = static_cast<std::size_t>(count) * kStreams * head_dim;
    const auto keys = test::random_rows(static_cast<std::size_t>(count) * kStreams, head_dim, seed + 2 * call, 3);
    const auto values = test::random_rows(static_cast<std::size_t>(count) * kStreams, head_dim, seed + 2 * call + 1);
    REQUIRE(keys.size() == floats);
    if (count == 1) {
      cache.append(seq, 0, std::span<const float>(keys), std::span<const float>(values), written);
    } else {
      cache.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values));
    }
    written += count;
    for (index_t s = 0; s < kStreams; ++s) {
      const auto params = cache.codec_params(0, s);
      runner.append(streams[s], keys.data() + s * head_dim, values.data() + s * head_dim, kStreams * head_dim, count,
                    params);
    }

    for (index_t s = 0; s < kStreams; ++s) {
      INFO(Quantizer::name() << " page " << rule.page_size << " prefix " << rule.window.exact_prefix_tokens
                             << " tail " << rule.window.tail_tokens << ", call " << call << " (" << count
                             << " rows), stream " << s);
      const HostStream& mine = streams[s];
      const std::span<const PageId> ids = cache.pages(seq, 0, s);
      REQUIRE(mine.pages.size() == ids.size());
      const std::size_t key_bytes = cache.quantizer().key.plane_bytes({rule.page_size, head_dim});
      const std::size_t value_bytes = cache.quantizer().value.plane_bytes({rule.page_size, head_dim});
      for (std::size_t p = 0; p < ids.size(); ++p) {
        const std::byte* theirs = cache.pool().payload(ids[p]);
        CHECK(std::memcmp(mine.pages[p].data(), theirs, key_bytes) == 0);
        CHECK(std::memcmp(mine.pages[p].data() + cache.value_plane_offset(), theirs + cache.value_plane_offset(),
                          value_bytes) == 0);
      }
      // read_back: exact prefix rows, the pages' slots, then the tail rows.
      const StoredTokens stored = cache.read_back(seq, 0, s);
      const index_t paged = static_cast<index_t>(ids.size()) * rule.page_size;
      REQUIRE(stored.size() == mine.rows.total() + paged);
      REQUIRE(mine.rows.prefix == std::min(rule.window.exact_prefix_tokens, written));
      const std::size_t d = static_cast<std::size_t>(head_dim);
      auto same_rows = [&](index_t mine_first, index_t theirs_first, index_t rows) {
        const std::size_t n = static_cast<std::size_t>(rows) * d * sizeof(float);
        return std::memcmp(mine.keys.data() + mine_first * d, stored.keys.data() + theirs_first * d, n) == 0 &&
               std::memcmp(mine.values.data() + mine_first * d, stored.values.data() + theirs_first * d, n) == 0;
      };
      CHECK(same_rows(0, 0, mine.rows.prefix));
      CHECK(same_rows(mine.rows.prefix, mine.rows.prefix + paged, mine.rows.tail));
    }
  }
}

template <class Quantizer>
void check_rules(index_t page_size, index_t head_dim, std::uint32_t seed) {
  check_plan_against_cache<Quantizer>({page_size, 0, 0}, head_dim, seed);
  check_plan_against_cache<Quantizer>({page_size, 5, 0}, head_dim, seed + 100);
  check_plan_against_cache<Quantizer>({page_size, 0, page_size}, head_dim, seed + 200);
  check_plan_against_cache<Quantizer>({page_size, 3, 3 * page_size}, head_dim, seed + 300);
}

}  // namespace

TEST_CASE("a device append plan leaves the pages and rows a KVCache holds", "[kernels][cuda_plan]") {
  check_rules<quant::Float<kvpack::half>>(16, 64, 10);
  check_rules<quant::Q4_0>(32, 64, 20);
  check_rules<quant::Int8>(16, 96, 30);
  check_rules<quant::KIVI<4, 32>>(32, 128, 40);
  check_rules<quant::KIVI<2, 32>>(64, 64, 50);
}

TEST_CASE("a device append plan follows a KVCache under random rules", "[kernels][cuda_plan]") {
  // Exact prefixes up to 40 rows (filled across several appends, or crossed by one), tail windows
  // of up to three pages; the plan does not depend on the codec, so f16 at a small head_dim.
  std::mt19937 rng(77);
  for (std::uint32_t i = 0; i < 16; ++i) {
    const index_t page = 16 * std::uniform_int_distribution<index_t>(1, 4)(rng);
    const index_t prefix = std::uniform_int_distribution<index_t>(0, 40)(rng);
    const index_t tail = page * std::uniform_int_distribution<index_t>(0, 3)(rng);
    check_plan_against_cache<quant::Float<kvpack::half>>({page, prefix, tail}, 16, 1000 + 10 * i);
  }
}

TEST_CASE("a device append plan rejects what no cache can hold", "[kernels][cuda_plan]") {
  using kernels::cuda::plan_row_append;
  CHECK_THROWS_AS(plan_row_append({0, 0}, -1, {16, 0, 0}), Error);
  CHECK_THROWS_AS(plan_row_append({0, 0}, 4, {0, 0, 0}), Error);
  CHECK_THROWS_AS(plan_row_append({2, 1}, 4, {16, 3, 0}), Error);  // tail rows before the prefix is full
  CHECK_THROWS_AS(plan_row_append({4, 0}, 4, {16, 3, 0}), Error);  // more prefix rows than the rule's
  CHECK_NOTHROW(plan_row_append({3, 40}, 1, {16, 3, 0}));          // a tail longer than the rule keeps
}

TEST_CASE("a device append plan encodes pages the moment the tail window overflows", "[kernels][cuda_plan]") {
  using kernels::cuda::plan_row_append;
  const RowRule rule{16, 2, 32};
  // 47 tail rows and one more: the window (32) plus a page (16) is full, one page goes.
  const RowAppendPlan one = plan_row_append({2, 47}, 1, rule);
  CHECK(one.new_pages == 1);
  CHECK(one.after == StoredRows{2, 32});
  // 31 tail rows are still inside the window.
  CHECK(plan_row_append({2, 30}, 1, rule).new_pages == 0);
  CHECK(plan_row_append({2, 0}, 100, rule).new_pages == 4);  // (100 − 32) / 16
  CHECK(plan_row_append({2, 0}, 100, rule).after == StoredRows{2, 36});
  // An empty layer: the first rows are the prefix, whatever the count.
  CHECK(plan_row_append({0, 0}, 1, rule).after == StoredRows{1, 0});
  CHECK(plan_row_append({0, 0}, 5, rule).after == StoredRows{2, 3});
}
