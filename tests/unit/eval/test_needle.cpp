// eval/needle.hpp: the failure case. Full precision must recall the needle at every depth; a
// policy that loses the middle of the context must be caught; the construction must really hide
// the needle from the prompt's queries and make the question depend on it.

#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <vector>

#include "kvpack/eval/exact_attention.hpp"
#include "kvpack/eval/needle.hpp"

using namespace kvpack;
using namespace kvpack::eval;

namespace {

NeedleSpec small_spec() {
  NeedleSpec spec;
  spec.workload.kv_heads = 2;
  spec.workload.q_heads = 8;
  spec.contexts = {512, 2048};
  spec.decode_steps = 3;
  return spec;
}

/// A deliberately broken policy: an f32 cache that silently zeroes the values of the middle half
/// of every prefill, the way an evictor loses a middle needle.
class ForgetfulCache final : public AnyCache {
 public:
  explicit ForgetfulCache(std::unique_ptr<AnyCache> inner) : inner_(std::move(inner)) {}
  const ModelShape& shape() const noexcept override { return inner_->shape(); }
  const CacheConfig& config() const noexcept override { return inner_->config(); }
  SeqId add_sequence() override { return inner_->add_sequence(); }
  void prefill(SeqId seq, index_t layer, std::span<const float> keys, std::span<const float> values,
               std::span<const float> window) override {
    std::vector<float> forgotten(values.begin(), values.end());
    std::fill(forgotten.begin() + static_cast<std::ptrdiff_t>(forgotten.size() / 4),
              forgotten.begin() + static_cast<std::ptrdiff_t>(3 * forgotten.size() / 4), 0.0f);
    inner_->prefill(seq, layer, keys, forgotten, window);
  }
  void append(SeqId seq, index_t layer, std::span<const float> k, std::span<const float> v, std::int64_t p) override {
    inner_->append(seq, layer, k, v, p);
  }
  void attend(SeqId seq, index_t layer, std::span<const float> q, std::span<float> out, float scale) const override {
    inner_->attend(seq, layer, q, out, scale);
  }
  bool certifies_unread() const noexcept override { return inner_->certifies_unread(); }
  void attend_reported(SeqId seq, index_t layer, std::span<const float> q, std::span<float> out, float scale,
                       AttendReport& report) const override {
    inner_->attend_reported(seq, layer, q, out, scale, report);
  }
  SeqId fork(SeqId seq) override { return inner_->fork(seq); }
  void release(SeqId seq) override { inner_->release(seq); }
  void pin(SeqId seq, std::int64_t first, std::int64_t last) override { inner_->pin(seq, first, last); }
  index_t length(SeqId seq, index_t layer) const override { return inner_->length(seq, layer); }
  index_t live_tokens(SeqId seq, index_t layer, index_t stream) const override {
    return inner_->live_tokens(seq, layer, stream);
  }
  MemoryUsage memory() const noexcept override { return inner_->memory(); }
  StoredTokens read_back(SeqId seq, index_t layer, index_t stream) const override {
    return inner_->read_back(seq, layer, stream);
  }
  double nominal_bits_per_element() const noexcept override { return 32; }

 private:
  std::unique_ptr<AnyCache> inner_;
};

}  // namespace

TEST_CASE("a needle spec with a context twice, and exact attention over partial rows, are rejected",
          "[eval][needle]") {
  NeedleSpec twice = small_spec();
  twice.contexts = {twice.contexts.front(), twice.contexts.front()};
  CHECK_THROWS_AS(twice.validate(), Error);  // its trials would all land in the first row
  const std::vector<float> keys(2 * 2 * 8), values(keys.size()), query(4 * 8);
  CHECK_NOTHROW(exact_attention(keys, values, 2, 8, query, 1.0));
  CHECK_THROWS_AS(exact_attention(std::span(keys).first(20), std::span(values).first(20), 2, 8, query, 1.0), Error);
  CHECK_THROWS_AS(exact_attention(keys, values, 2, 8, std::span(query).first(12), 1.0), Error);  // a partial head
  CHECK_THROWS_AS(exact_attention(keys, values, 4, 4, std::span(query).first(12), 1.0), Error);  // 3 heads over 4
}

TEST_CASE("KeepAll with Float codecs recalls the needle at every depth and context", "[eval][needle]") {
  const NeedleSuite suite(small_spec());
  for (const char* name : {"f32", "f16", "bf16"}) {
    INFO(name);
    const NeedleReport report = suite.run(find_policy(name));
    REQUIRE(report.cells.size() == 2 * 11);
    for (const NeedleCell& cell : report.cells) {
      INFO("context " << cell.context << " depth " << cell.depth << " worst error " << cell.worst_error);
      CHECK(cell.trials == 8);
      CHECK(cell.recall() == 1.0);
    }
    CHECK(report.compact(512) == "###########");
  }
}

TEST_CASE("8-bit and 4-bit quantizers recall the needle at every depth", "[eval][needle]") {
  // EVAL.md §2 expects ~100 % for quantizers of 4 bits and more: the needle's coefficient only
  // moves by the codec's relative error (q4_0 ~ 5 %), well inside the 10 % tolerance.
  const NeedleSuite suite(small_spec());
  for (const char* name : {"fp8-e4m3", "int8", "q8_0", "q4_0"}) {
    INFO(name);
    CHECK(suite.run(find_policy(name)).recall() == 1.0);
  }
}

TEST_CASE("a policy that loses the middle of the context fails the needle there and only there",
          "[eval][needle]") {
  const NeedleSuite suite(small_spec());
  const Policy f32 = find_policy("f32");
  const Policy forgetful{"forgetful", "f32 losing the middle half",
                         [&](const ModelShape& shape, const CacheConfig& config,
                             const PolicyInputs&) -> std::unique_ptr<AnyCache> {
                           return std::make_unique<ForgetfulCache>(f32.make(shape, config));
                         }};
  const NeedleReport report = suite.run(forgetful);
  // Tokens [T/4, 3T/4) lose their values: depths 0.3–0.7 fall inside, 0.2 (token 0.2·(T−1)) and
  // 0.8 just outside.
  CHECK(report.compact(512) == "###.....###");
  CHECK(report.compact(2048) == "###.....###");
  // It reads every token it holds, so the detector, which bounds only what was not read, cannot
  // see the loss: every failure is a miss.
  const DetectorRates rates = report.detector();
  CHECK(rates.failed == 2 * 5 * 8);
  CHECK(rates.misses == rates.failed);
  CHECK(report.compact_fired(512) == "...........");
}

TEST_CASE("the needle is ignored by the prompt's queries and dominates the question", "[eval][needle]") {
  // Rebuild one trial's inputs the way NeedleSuite does and check the two halves of the
  // construction with exact attention: the observation-window queries give the needle about
  // as much as an average token, the question at least needle_mass.
  NeedleSpec spec = small_spec();
  spec.contexts = {1024};
  spec.depths = {0.5};
  spec.decode_steps = 0;
  const NeedleSuite suite(spec);
  double question_mass = 0, window_mass = 0;
  int heads = 0;
  suite.inspect_trial(0, 0.5, [&](const LayerKV& kv, index_t needle, std::span<const float> window,
                                  std::span<const float> question) {
    const index_t d = kv.head_dim, group = spec.workload.q_heads / spec.workload.kv_heads;
    const std::ptrdiff_t stride = static_cast<std::ptrdiff_t>(kv.kv_heads) * d;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    std::vector<double> out(static_cast<std::size_t>(d)), p;
    for (std::size_t row = 0; row < question.size() / d; ++row) {
      const index_t head = static_cast<index_t>(row) / group;
      exact_attention_head({kv.keys.data() + head * d, stride, kv.tokens, d},
                           {kv.values.data() + head * d, stride, kv.tokens, d}, &question[row * d], scale,
                           out.data(), &p);
      question_mass += p[needle];
      ++heads;
    }
    for (std::size_t row = 0; row < window.size() / d; ++row) {
      const index_t head = static_cast<index_t>(row % spec.workload.q_heads) / group;
      exact_attention_head({kv.keys.data() + head * d, stride, kv.tokens, d},
                           {kv.values.data() + head * d, stride, kv.tokens, d}, &window[row * d], scale,
                           out.data(), &p);
      window_mass = std::max(window_mass, p[needle]);
    }
  });
  CHECK(question_mass / heads >= spec.needle_mass * 0.95);  // the question's noise moves it a little
  CHECK(window_mass < 10.0 / 1024);  // no window query gives it more than ten average tokens' share
}

namespace {

/// The needle at 2048 tokens, no decode step: the built-in evictors keep 512 tokens (25 %).
NeedleSpec eviction_spec() {
  NeedleSpec spec = small_spec();
  spec.contexts = {2048};
  spec.decode_steps = 0;
  return spec;
}

std::vector<Policy> evictor_policies() {
  std::vector<Policy> evictors;
  for (Policy& policy : builtin_policies()) {
    if (policy.budget_tokens > 0) evictors.push_back(std::move(policy));
  }
  return evictors;
}

}  // namespace

TEST_CASE("SnapKV at a quarter of the context loses middle needles the full cache recalls", "[eval][needle][evict]") {
  const NeedleSpec spec = eviction_spec();
  const NeedleSuite suite(spec);
  const Policy policies[] = {find_policy("f16"), find_policy("snapkv")};
  const std::vector<NeedleReport> reports = suite.run(policies);
  CHECK(reports[0].compact(2048) == "###########");
  CHECK(reports[0].compact(2048, true) == "###########");
  const NeedleReport& snapkv = reports[1];
  int lost_in_middle = 0;
  for (const NeedleCell& cell : snapkv.cells) {
    INFO("depth " << cell.depth << " recall " << cell.recall() << " retrieval " << cell.retrieval());
    CHECK(cell.retrieved >= cell.recalled);
    if (cell.depth >= 0.2 && cell.depth <= 0.8 && cell.retrieval() < 1.0) ++lost_in_middle;
  }
  // The prompt's queries never look at the needle, so the observation window ranks it low.
  CHECK(lost_in_middle > 0);
  // The last token sits in SnapKV's window, which it always keeps.
  CHECK(snapkv.cells.back().retrieval() == 1.0);
}

TEST_CASE("StreamingLLM retrieves the needle exactly when it is a sink or recent", "[eval][needle][evict]") {
  const NeedleSpec spec = eviction_spec();
  const Policy policy = find_policy("streaming-llm");
  const index_t sinks = 4, context = spec.contexts.front();
  const NeedleReport report = NeedleSuite(spec).run(policy);
  for (const NeedleCell& cell : report.cells) {
    const index_t position = static_cast<index_t>(std::floor(cell.depth * (context - 1)));
    const bool kept = position < sinks || position >= context - (policy.budget_tokens - sinks);
    INFO("depth " << cell.depth << " position " << position << " worst error " << cell.worst_error);
    CHECK(cell.retrieval() == (kept ? 1.0 : 0.0));
  }
}

TEST_CASE("a needle inside a pinned span is retrieved at every depth by every evictor", "[eval][needle][evict]") {
  NeedleSpec spec = eviction_spec();
  spec.depths = {0.3, 0.5, 0.7};  // the middle, where every evictor loses an unpinned needle
  const std::vector<Policy> evictors = evictor_policies();
  REQUIRE(evictors.size() >= 4);
  const std::vector<NeedleReport> unpinned = NeedleSuite(spec).run(evictors);
  spec.pinned_span = 16;
  const std::vector<NeedleReport> pinned = NeedleSuite(spec).run(evictors);
  for (std::size_t p = 0; p < evictors.size(); ++p) {
    INFO(evictors[p].name << ": unpinned " << unpinned[p].compact(2048, true) << ", pinned "
                          << pinned[p].compact(2048, true));
    CHECK(unpinned[p].retrieval() < 1.0);  // without the pin some needle is lost: the pin is what keeps it
    CHECK(pinned[p].compact(2048, true) == "###");
  }
}

TEST_CASE("a needle that did not run has no recall, not a recall of 0", "[eval][needle]") {
  const NeedleReport none;
  CHECK(std::isnan(none.recall()));
  CHECK(std::isnan(none.retrieval()));
}
