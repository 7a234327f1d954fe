// Quest page selection (select/quest.hpp) and the certified bound on the attention mass of the
// tokens a step did not read (select/unread_bound.hpp), against brute force computed here in
// double: every key of a page under its bound (random, outlier channels, negative and zero
// queries, a real q4_0 cache's decoded keys), top-k selection against a stable sort, and the mass
// bound against the true softmax over random and adversarial workloads.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "kvpack/select/quest.hpp"
#include "kvpack/select/unread_bound.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;

double dot(const float* a, const float* b, index_t d) {
  double s = 0.0;
  for (index_t c = 0; c < d; ++c) s += static_cast<double>(a[c]) * b[c];
  return s;
}

/// Min and max per channel over the written slots, by brute force.
struct Box {
  std::vector<float> min, max;
};
Box brute_box(const std::vector<float>& keys, index_t page_size, index_t d, const std::vector<bool>& written) {
  Box box{std::vector<float>(d, std::numeric_limits<float>::infinity()),
          std::vector<float>(d, -std::numeric_limits<float>::infinity())};
  for (index_t t = 0; t < page_size; ++t) {
    if (!written[t]) continue;
    for (index_t c = 0; c < d; ++c) {
      box.min[c] = std::min(box.min[c], keys[t * d + c]);
      box.max[c] = std::max(box.max[c], keys[t * d + c]);
    }
  }
  return box;
}

/// Σ_c max(q_c·min_c, q_c·max_c) in double, and the rounding allowance quest.hpp may add on top
/// (about 2^-19·max|q|·Σ(|min| + |max|) for head_dim 128; 1e-5 leaves room for every d here).
double box_bound(const float* q, const float* min, const float* max, index_t d) {
  double s = 0.0;
  for (index_t c = 0; c < d; ++c) s += std::max(static_cast<double>(q[c]) * min[c], static_cast<double>(q[c]) * max[c]);
  return s;
}
double allowance(const float* q, const float* min, const float* max, index_t d) {
  double q_max = 0.0, k_abs = 0.0;
  for (index_t c = 0; c < d; ++c) {
    q_max = std::max(q_max, static_cast<double>(std::fabs(q[c])));
    k_abs += std::fabs(min[c]) + std::fabs(max[c]);
  }
  return 1e-5 * q_max * k_abs;
}

std::vector<std::uint64_t> mask_of(const std::vector<bool>& slots) {
  std::vector<std::uint64_t> mask((slots.size() + 63) / 64, 0);
  for (std::size_t t = 0; t < slots.size(); ++t) {
    if (slots[t]) mask[t / 64] |= std::uint64_t{1} << (t % 64);
  }
  return mask;
}

/// Checks one page: the summary against brute force, and the bound for `q` against every
/// written key and against the exact box bound.
void check_page(const std::vector<float>& keys, const std::vector<bool>& written, index_t page_size, index_t d,
                const std::vector<float>& q) {
  const std::vector<std::uint64_t> mask = mask_of(written);
  std::vector<float> min(d), max(d);
  select::summarize_page(keys.data(), mask.data(), page_size, d, min.data(), max.data());
  const Box box = brute_box(keys, page_size, d, written);
  REQUIRE(min == box.min);
  REQUIRE(max == box.max);
  const float u = select::page_upper_bound(q.data(), min.data(), max.data(), d);
  const double exact = box_bound(q.data(), box.min.data(), box.max.data(), d);
  CHECK(u >= exact);
  CHECK(u <= exact + allowance(q.data(), min.data(), max.data(), d));
  for (index_t t = 0; t < page_size; ++t) {
    if (!written[t]) continue;
    INFO("slot " << t << " d=" << d);
    CHECK(static_cast<double>(u) >= dot(q.data(), keys.data() + t * d, d));
  }
}

}  // namespace

TEST_CASE("Quest page bound is at least q.k for every key of the page", "[quest][select]") {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const index_t d : {8, 100, 128}) {
    for (const index_t page_size : {16, 32}) {
      for (const int outliers : {0, 4}) {
        for (std::uint32_t seed = 0; seed < 4; ++seed) {
          const std::vector<float> keys =
              test::random_rows(static_cast<std::size_t>(page_size), d, 1000 + seed, outliers, 20.0f);
          std::vector<bool> written(page_size, true);
          if (seed % 2 == 1) written[3] = written[page_size - 1] = false;  // never-written slots
          std::vector<float> q(d);
          for (float& x : q) x = normal(rng) * 0.3f;
          check_page(keys, written, page_size, d, q);
          for (float& x : q) x = -std::fabs(x);  // every channel negative: the min row is used
          check_page(keys, written, page_size, d, q);
        }
      }
      // A zero query bounds every page by exactly 0; zero keys give 0 for any query.
      const std::vector<float> keys = test::random_rows(static_cast<std::size_t>(page_size), d, 77, 2);
      std::vector<float> min(d), max(d);
      select::summarize_page(keys.data(), nullptr, page_size, d, min.data(), max.data());
      const std::vector<float> zero(d, 0.0f);
      CHECK(select::page_upper_bound(zero.data(), min.data(), max.data(), d) == 0.0f);
      const std::vector<float> zero_keys(static_cast<std::size_t>(page_size) * d, 0.0f);
      select::summarize_page(zero_keys.data(), nullptr, page_size, d, min.data(), max.data());
      std::vector<float> q(d);
      for (float& x : q) x = normal(rng);
      CHECK(select::page_upper_bound(q.data(), min.data(), max.data(), d) == 0.0f);
    }
  }
}

TEST_CASE("Quest page bound equals q.k when the page holds one distinct key", "[quest][select]") {
  const index_t d = 128, page_size = 32;
  const std::vector<float> key = test::random_rows(1, d, 5, 4, 20.0f);
  std::vector<float> keys;
  for (index_t t = 0; t < page_size; ++t) keys.insert(keys.end(), key.begin(), key.end());
  std::vector<float> min(d), max(d);
  select::summarize_page(keys.data(), nullptr, page_size, d, min.data(), max.data());
  CHECK(min == key);
  CHECK(max == key);
  for (std::uint32_t seed = 0; seed < 8; ++seed) {
    const std::vector<float> q = test::random_rows(1, d, 50 + seed);
    const double score = dot(q.data(), key.data(), d);
    const float u = select::page_upper_bound(q.data(), min.data(), max.data(), d);
    CHECK(u >= score);
    CHECK(u <= score + allowance(q.data(), min.data(), max.data(), d));
  }
}

TEST_CASE("Quest summaries skip never-written slots; an empty page bounds nothing", "[quest][select]") {
  const index_t d = 16, page_size = 8;
  std::vector<float> keys = test::random_rows(page_size, d, 9);
  keys[2 * d] = 1e6f;  // slot 2, channel 0: must not enter the summary when unwritten
  std::vector<bool> written(page_size, true);
  written[2] = false;
  const std::vector<std::uint64_t> mask = mask_of(written);
  std::vector<float> min(d), max(d);
  select::summarize_page(keys.data(), mask.data(), page_size, d, min.data(), max.data());
  CHECK(max[0] < 100.0f);
  const std::uint64_t none = 0;
  select::summarize_page(keys.data(), &none, page_size, d, min.data(), max.data());
  const std::vector<float> q(d, 1.0f);
  CHECK(select::page_upper_bound(q.data(), min.data(), max.data(), d) == -std::numeric_limits<float>::infinity());
}

TEST_CASE("Quest bound holds for a q4_0 cache's decoded keys", "[quest][select]") {
  const ModelShape shape{1, 4, 2, 64};
  KVCache<layout::GQA, quant::Q4_0> cache(shape);
  const index_t tokens = 96;
  const std::vector<float> keys = test::random_rows(static_cast<std::size_t>(tokens) * shape.kv_heads, shape.head_dim,
                                                    31, 3, 15.0f);
  const std::vector<float> values = test::random_rows(static_cast<std::size_t>(tokens) * shape.kv_heads, shape.head_dim, 32);
  const SeqId seq = cache.add_sequence();
  cache.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values));
  const index_t page_size = cache.config().page_size;
  const index_t d = shape.head_dim;
  std::vector<float> decoded(static_cast<std::size_t>(page_size) * d), min(d), max(d);
  int pages_checked = 0;
  bool quantization_visible = false;
  for (index_t s = 0; s < shape.kv_heads; ++s) {
    const auto key_params = cache.codec_params(0, s).first;
    const std::span<const PageId> pages = cache.pages(seq, 0, s);
    for (std::size_t i = 0; i < pages.size(); ++i) {
      cache.quantizer().key.decode(quant::PageGeometry{page_size, d}, cache.pool().payload(pages[i]), key_params,
                                   decoded.data());
      select::summarize_page(decoded.data(), nullptr, page_size, d, min.data(), max.data());
      // Token t of stream s is keys[(t * kv_heads + s) * d ...].
      for (index_t t = 0; t < page_size && !quantization_visible; ++t) {
        const std::size_t token = i * page_size + t;
        for (index_t c = 0; c < d; ++c) {
          if (decoded[t * d + c] != keys[(token * shape.kv_heads + s) * d + c]) quantization_visible = true;
        }
      }
      for (std::uint32_t seed = 0; seed < 6; ++seed) {
        std::vector<float> q = test::random_rows(1, d, 400 + seed, 2, 5.0f);
        if (seed % 3 == 2) {
          for (float& x : q) x = -std::fabs(x);
        }
        const float u = select::page_upper_bound(q.data(), min.data(), max.data(), d);
        for (index_t t = 0; t < page_size; ++t) {
          INFO("stream " << s << " page " << i << " slot " << t);
          CHECK(static_cast<double>(u) >= dot(q.data(), decoded.data() + t * d, d));
        }
      }
      ++pages_checked;
    }
  }
  CHECK(pages_checked >= 2 * shape.kv_heads);  // the prefill filled pages, not only the tail
  CHECK(quantization_visible);                 // the decoded keys are not the inputs
}

TEST_CASE("Quest group bounds: per head as page_upper_bound, aggregated by max or mean", "[quest][select]") {
  const index_t d = 64, page_size = 16, pages = 12, group = 4;
  std::vector<std::vector<float>> summaries(pages, std::vector<float>(2 * d));
  std::vector<const float*> pointers(pages);
  for (index_t p = 0; p < pages; ++p) {
    const std::vector<float> keys = test::random_rows(page_size, d, 600 + p, p % 3, 8.0f);
    select::summarize_page(keys.data(), nullptr, page_size, d, summaries[p].data(), summaries[p].data() + d);
    pointers[p] = summaries[p].data();
  }
  const std::vector<float> queries = test::random_rows(group, d, 700);
  std::vector<float> head_bounds(static_cast<std::size_t>(group) * pages), page_max(pages), page_mean(pages);
  select::group_page_bounds(queries, group, d, pointers, head_bounds, page_max, select::GroupBound::kMax);
  select::group_page_bounds(queries, group, d, pointers, {}, page_mean, select::GroupBound::kMean);
  for (index_t p = 0; p < pages; ++p) {
    float top = -std::numeric_limits<float>::infinity();
    double sum = 0.0;
    for (index_t h = 0; h < group; ++h) {
      const float u = select::page_upper_bound(queries.data() + h * d, pointers[p], pointers[p] + d, d);
      CHECK(head_bounds[h * pages + p] == u);
      top = std::max(top, u);
      sum += u;
    }
    CHECK(page_max[p] == top);
    CHECK(page_mean[p] == Approx(sum / group).epsilon(1e-5).margin(1e-5));
  }
  std::vector<float> short_out(pages - 1);
  try {
    select::group_page_bounds(queries, group, d, pointers, {}, short_out);
    FAIL("a page_bounds span of the wrong size was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
  }
  CHECK_THROWS_AS(select::group_page_bounds(std::span<const float>(queries).first(d), group, d, pointers, {}, page_max),
                  Error);
}

TEST_CASE("Quest bound: every compiled variant (AVX-512, AVX2, the file's own flags) is certified", "[quest][select]") {
  select::detail::for_each_page_bounds_variant([&](const char* name, select::detail::PageBoundsFunction bounds_of) {
    for (const index_t d : {8, 40, 100, 128}) {
      // Groups past one pass of split queries (16 heads at d = 128), pages past one chunk (256).
      for (const index_t group : {1, 3, 4, 5, 20}) {
        const index_t pages = d == 100 || (d == 128 && group == 20) ? 300 : 9;
        const index_t page_size = 16;
        std::vector<std::vector<float>> keys(pages), summaries(pages, std::vector<float>(2 * d));
        std::vector<const float*> pointers(pages);
        for (index_t p = 0; p < pages; ++p) {
          keys[p] = test::random_rows(page_size, d, 800 + p, 3, 12.0f);
          select::summarize_page(keys[p].data(), nullptr, page_size, d, summaries[p].data(), summaries[p].data() + d);
          pointers[p] = summaries[p].data();
        }
        std::vector<float> queries = test::random_rows(group, d, 900 + d);
        for (index_t c = 0; c < d; c += 3) queries[c] = -std::fabs(queries[c]) * 4.0f;
        std::vector<float> head_bounds(static_cast<std::size_t>(group) * pages), page_bounds(pages);
        bounds_of(queries.data(), group, d, pointers.data(), pages, head_bounds.data(), page_bounds.data(),
                  select::GroupBound::kMax);
        for (index_t h = 0; h < group; ++h) {
          const float* q = queries.data() + h * d;
          for (index_t p = 0; p < pages; ++p) {
            const double exact = box_bound(q, pointers[p], pointers[p] + d, d);
            const float u = head_bounds[h * pages + p];
            INFO(name << " d=" << d << " group " << group << " head " << h << " page " << p);
            CHECK(u >= exact);
            CHECK(u <= exact + allowance(q, pointers[p], pointers[p] + d, d));
            for (index_t t = 0; t < page_size; ++t) CHECK(static_cast<double>(u) >= dot(q, keys[p].data() + t * d, d));
          }
        }
      }
    }
  });
}

TEST_CASE("Quest top-k matches a stable sort, ties to the lower page, in page order (heap and selection paths)",
          "[quest][select]") {
  std::mt19937 rng(23);
  for (const index_t n : {0, 1, 5, 37, 200}) {
    for (int trial = 0; trial < 6; ++trial) {
      std::vector<float> bounds(n);
      // Half the trials draw from 4 values, so most comparisons are ties.
      std::uniform_int_distribution<int> few(0, 3);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (float& b : bounds) b = trial % 2 == 0 ? static_cast<float>(few(rng)) : normal(rng);
      for (const index_t k : {0, 1, 2, 3, n / 2, n - 1, n, n + 3}) {
        if (k < 0) continue;
        std::vector<index_t> expected(n);
        std::iota(expected.begin(), expected.end(), 0);
        std::stable_sort(expected.begin(), expected.end(), [&](index_t a, index_t b) { return bounds[a] > bounds[b]; });
        expected.resize(std::min(k, n));
        std::sort(expected.begin(), expected.end());
        // Room for k indices takes the heap; room for all n, nth_element.
        for (const index_t room : {k, std::max(k, n)}) {
          std::vector<index_t> out(static_cast<std::size_t>(room), -1);
          const index_t count = select::select_top_pages(bounds, k, out);
          out.resize(static_cast<std::size_t>(count));
          INFO("n=" << n << " k=" << k << " room " << room << " trial " << trial);
          CHECK(out == expected);
        }
      }
    }
  }
  // NaN ranks first (a page with an unknown bound must be read); bad arguments throw.
  const std::vector<float> with_nan{1.0f, std::numeric_limits<float>::quiet_NaN(), 5.0f, 5.0f};
  std::vector<index_t> out(2);
  CHECK(select::select_top_pages(with_nan, 2, out) == 2);
  CHECK(out == std::vector<index_t>{1, 2});
  try {
    (void)select::select_top_pages(with_nan, -1, out);
    FAIL("k < 0 was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
  }
  CHECK_THROWS_AS(select::select_top_pages(with_nan, 3, out), Error);  // out holds 2 of 3
}

TEST_CASE("Quest policy: budget in pages, dense layers, summary size", "[quest][select]") {
  static_assert(select::PageSelector<select::Quest>);
  const select::Quest quest;
  CHECK(quest.summary_bytes(32, 128) == (2 * 128 + 2) * sizeof(float));
  CHECK(quest.pages_to_read(1000, 32) == 4096 / 32);
  CHECK(quest.pages_to_read(50, 32) == 50);
  CHECK(quest.pages_to_read(0, 32) == 0);
  select::Quest small;
  small.token_budget = 16;
  CHECK(small.pages_to_read(100, 32) == 3);  // the minimum of 3 pages
  CHECK(small.pages_to_read(2, 32) == 2);
  CHECK(quest.reads_densely(1));
  CHECK_FALSE(quest.reads_densely(2));
  select::Quest bad;
  bad.min_pages = -1;
  CHECK_THROWS_AS(bad.validate(), Error);
  CHECK_NOTHROW(quest.validate());
}

namespace {

/// One query head's decode step over pages of which some are read, by brute force in double.
struct Workload {
  index_t d = 32, page_size = 16, pages = 24;
  std::vector<float> keys;    // [pages][page_size][d]
  std::vector<float> values;  // [pages][page_size][d]
  std::vector<float> query;   // [d], scale applied
  std::vector<bool> selected;  // [pages]
  std::vector<bool> live;      // [pages * page_size]: dead slots of read pages are unread too
};

struct Truth {
  double mass = 0.0;        // unread mass, exact
  double output_gap = 0.0;  // ‖out_all − out_read‖₂
  float running_max = -std::numeric_limits<float>::infinity();
  float running_sum = 0.0f;
  std::vector<float> bounds;     // [pages] U_p
  std::vector<index_t> unread;   // [pages]
  float max_value_norm = 0.0f;
};

double log_sum_exp(const std::vector<double>& x) {
  if (x.empty()) return -std::numeric_limits<double>::infinity();
  const double top = *std::max_element(x.begin(), x.end());
  double s = 0.0;
  for (double v : x) s += std::exp(v - top);
  return top + std::log(s);
}

Truth brute_force(const Workload& w) {
  Truth truth;
  std::vector<double> read_scores, unread_scores;
  std::vector<std::size_t> read_tokens, all_tokens;
  truth.bounds.resize(w.pages);
  truth.unread.assign(w.pages, 0);
  std::vector<float> min(w.d), max(w.d);
  for (index_t p = 0; p < w.pages; ++p) {
    const float* page = w.keys.data() + static_cast<std::size_t>(p) * w.page_size * w.d;
    select::summarize_page(page, nullptr, w.page_size, w.d, min.data(), max.data());  // every slot that lived
    truth.bounds[p] = select::page_upper_bound(w.query.data(), min.data(), max.data(), w.d);
    for (index_t t = 0; t < w.page_size; ++t) {
      const std::size_t token = static_cast<std::size_t>(p) * w.page_size + t;
      const double s = dot(w.query.data(), page + static_cast<std::size_t>(t) * w.d, w.d);
      all_tokens.push_back(token);
      if (w.selected[p] && w.live[token]) {
        read_scores.push_back(s);
        read_tokens.push_back(token);
      } else {
        unread_scores.push_back(s);
        ++truth.unread[p];
      }
      truth.max_value_norm = std::max(truth.max_value_norm,
                                      static_cast<float>(std::sqrt(dot(w.values.data() + token * w.d,
                                                                       w.values.data() + token * w.d, w.d))) * 1.0001f);
    }
  }
  // m and Z as a float kernel would hand them over.
  if (!read_scores.empty()) {
    truth.running_max = static_cast<float>(*std::max_element(read_scores.begin(), read_scores.end()));
    double z = 0.0;
    for (double s : read_scores) z += std::exp(s - truth.running_max);
    truth.running_sum = static_cast<float>(z);
  }
  // The exact unread mass, in log space (a needle may sit hundreds of nats above m).
  const double log_read = log_sum_exp(read_scores);
  const double log_unread = log_sum_exp(unread_scores);
  if (unread_scores.empty()) {
    truth.mass = 0.0;
  } else if (read_scores.empty()) {
    truth.mass = 1.0;
  } else {
    truth.mass = 1.0 / (1.0 + std::exp(log_read - log_unread));
  }
  // Outputs over all tokens and over the read ones.
  std::vector<double> scores_all;
  for (std::size_t token : all_tokens) {
    scores_all.push_back(dot(w.query.data(), w.keys.data() + token * w.d, w.d));
  }
  const double log_all = log_sum_exp(scores_all);
  std::vector<double> out_all(w.d, 0.0), out_read(w.d, 0.0);
  for (std::size_t i = 0; i < all_tokens.size(); ++i) {
    const double p = std::exp(scores_all[i] - log_all);
    for (index_t c = 0; c < w.d; ++c) out_all[c] += p * w.values[all_tokens[i] * w.d + c];
  }
  for (std::size_t i = 0; i < read_tokens.size(); ++i) {
    const double p = std::exp(read_scores[i] - log_read);
    for (index_t c = 0; c < w.d; ++c) out_read[c] += p * w.values[read_tokens[i] * w.d + c];
  }
  if (!read_tokens.empty()) {
    double gap = 0.0;
    for (index_t c = 0; c < w.d; ++c) gap += (out_all[c] - out_read[c]) * (out_all[c] - out_read[c]);
    truth.output_gap = std::sqrt(gap);
  }
  return truth;
}

Workload random_workload(std::uint32_t seed, float sharpness, double read_fraction, double dead_fraction) {
  Workload w;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const std::size_t tokens = static_cast<std::size_t>(w.pages) * w.page_size;
  w.keys = test::random_rows(tokens, w.d, seed + 1, 2, 6.0f);
  w.values = test::random_rows(tokens, w.d, seed + 2);
  w.query = test::random_rows(1, w.d, seed + 3);
  for (float& x : w.query) x *= sharpness / std::sqrt(static_cast<float>(w.d));
  w.selected.resize(w.pages);
  for (index_t p = 0; p < w.pages; ++p) w.selected[p] = uniform(rng) < read_fraction;
  w.live.resize(tokens);
  for (std::size_t t = 0; t < tokens; ++t) w.live[t] = uniform(rng) >= dead_fraction;
  return w;
}

double bound_of(const Truth& t) { return select::unread_mass_bound(t.bounds, t.unread, t.running_max, t.running_sum); }

}  // namespace

TEST_CASE("Unread mass bound is at least the true unread mass: random workloads", "[quest][select]") {
  for (std::uint32_t seed = 0; seed < 40; ++seed) {
    const float sharpness = seed % 4 == 0 ? 0.5f : seed % 4 == 1 ? 1.0f : seed % 4 == 2 ? 3.0f : 10.0f;
    const Workload w = random_workload(100 * seed, sharpness, 0.25 + 0.015 * seed, seed % 3 == 0 ? 0.2 : 0.0);
    const Truth truth = brute_force(w);
    const double bound = bound_of(truth);
    INFO("seed " << seed << " sharpness " << sharpness << " true " << truth.mass << " bound " << bound);
    CHECK(bound >= truth.mass);
    CHECK(bound <= 1.0);
    // The output error bound, through the group API (two identical heads).
    std::vector<float> head_bounds = truth.bounds;
    head_bounds.insert(head_bounds.end(), truth.bounds.begin(), truth.bounds.end());
    const std::vector<float> maxes(2, truth.running_max), sums(2, truth.running_sum);
    std::vector<select::UnreadBound> out(2);
    select::unread_bounds(head_bounds, truth.unread, maxes, sums, truth.max_value_norm, out);
    CHECK(out[0].mass == bound);
    CHECK(out[1].mass == bound);
    CHECK(out[0].output_error >= truth.output_gap);
  }
}

TEST_CASE("Unread mass bound: needle, all unread, nothing unread, one-key page", "[quest][select]") {
  SECTION("a needle on an unread page holds almost all the mass") {
    Workload w = random_workload(7, 1.0f, 0.5, 0.0);
    index_t unread_page = 0;
    while (w.selected[unread_page]) ++unread_page;
    // Key = 40·q/‖q‖²: its score is 40 nats above the rest's typical few.
    const double q2 = dot(w.query.data(), w.query.data(), w.d);
    for (index_t c = 0; c < w.d; ++c) {
      w.keys[(static_cast<std::size_t>(unread_page) * w.page_size + 5) * w.d + c] = static_cast<float>(40.0 * w.query[c] / q2);
    }
    const Truth truth = brute_force(w);
    CHECK(truth.mass > 0.999);
    CHECK(bound_of(truth) >= truth.mass);
    std::vector<select::UnreadBound> out(1);
    select::unread_bounds(truth.bounds, truth.unread, std::vector<float>{truth.running_max},
                          std::vector<float>{truth.running_sum}, truth.max_value_norm, out);
    CHECK(out[0].fired(0.5));
  }
  SECTION("scores hundreds of nats apart do not overflow") {
    Workload w = random_workload(8, 60.0f, 0.3, 0.1);
    const Truth truth = brute_force(w);
    const double bound = bound_of(truth);
    CHECK(std::isfinite(bound));
    CHECK(bound >= truth.mass);
    CHECK(bound <= 1.0);
  }
  SECTION("nothing read: the bound is 1") {
    Workload w = random_workload(9, 1.0f, 0.0, 0.0);
    std::fill(w.selected.begin(), w.selected.end(), false);
    const Truth truth = brute_force(w);
    CHECK(truth.mass == 1.0);
    CHECK(bound_of(truth) == 1.0);
  }
  SECTION("nothing unread: the bound is 0 and never fires") {
    Workload w = random_workload(10, 1.0f, 1.0, 0.0);
    std::fill(w.selected.begin(), w.selected.end(), true);
    std::fill(w.live.begin(), w.live.end(), true);
    const Truth truth = brute_force(w);
    CHECK(truth.mass == 0.0);
    CHECK(bound_of(truth) == 0.0);
    CHECK_FALSE(select::UnreadBound{bound_of(truth), 0.0}.fired(0.0));
  }
  SECTION("an unread page of one repeated key: the bound is tight") {
    Workload w = random_workload(11, 2.0f, 0.5, 0.0);
    index_t unread_page = 0;
    while (w.selected[unread_page]) ++unread_page;
    for (index_t p = 0; p < w.pages; ++p) w.selected[p] = p != unread_page;  // the one unread page
    const std::vector<float> key = test::random_rows(1, w.d, 12);
    for (index_t t = 0; t < w.page_size; ++t) {
      std::copy(key.begin(), key.end(), w.keys.begin() + (static_cast<std::ptrdiff_t>(unread_page) * w.page_size + t) * w.d);
    }
    const Truth truth = brute_force(w);
    const double bound = bound_of(truth);
    CHECK(bound >= truth.mass);
    CHECK(bound <= truth.mass * (1.0 + 1e-4));
  }
  SECTION("bad arguments throw") {
    const std::vector<float> bounds{1.0f, 2.0f};
    const std::vector<index_t> one{1}, negative{1, -1};
    CHECK_THROWS_AS((void)select::unread_mass_bound(bounds, one, 0.0f, 1.0f), Error);
    CHECK_THROWS_AS((void)select::unread_mass_bound(bounds, negative, 0.0f, 1.0f), Error);
    // A page with unread tokens but no finite bound certifies nothing.
    const std::vector<float> nan_bound{std::numeric_limits<float>::quiet_NaN()};
    CHECK(select::unread_mass_bound(nan_bound, std::vector<index_t>{3}, 0.0f, 1.0f) == 1.0);
  }
}

TEST_CASE("Quest end to end on q4_0 pages: select, attend the selected pages, bound the rest", "[quest][select]") {
  // One KV head of 4 query heads, each with a needle key (score ~60) on its own page: summaries
  // of the decoded keys, pages attended by the real kernel over their pointers only, and the
  // certified bound from the kernel's own running max and sum, against the unread mass computed
  // from the decoded keys in double. Quest's top pages hold the needles (the bound says nothing
  // was missed); reading other pages instead makes the bound fire for every head.
  const ModelShape shape{1, 4, 1, 64};
  KVCache<layout::GQA, quant::Q4_0> cache(shape);
  const index_t tokens = 320, d = shape.head_dim, group = shape.group_size();
  std::vector<float> queries = test::random_rows(group, d, 43);
  for (float& x : queries) x *= 0.125f;  // 1/sqrt(64)
  std::vector<float> keys = test::random_rows(tokens, d, 41, 3, 6.0f);
  const std::vector<float> values = test::random_rows(tokens, d, 42);
  std::vector<index_t> needle_page(group);
  for (index_t h = 0; h < group; ++h) {
    const index_t token = 37 + 70 * h;  // pages 1, 3, 5, 7
    needle_page[h] = token / 32;
    const double q2 = dot(queries.data() + h * d, queries.data() + h * d, d);
    for (index_t c = 0; c < d; ++c) keys[token * d + c] = static_cast<float>(60.0 * queries[h * d + c] / q2);
  }
  const SeqId seq = cache.add_sequence();
  cache.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values));
  const index_t page_size = cache.config().page_size;
  REQUIRE(page_size == 32);
  const std::span<const PageId> ids = cache.pages(seq, 0, 0);
  const index_t pages = static_cast<index_t>(ids.size());
  REQUIRE(pages * page_size == tokens);  // no tail: every token is in a page
  // Not a structured binding: clang 14 cannot capture one in the lambda below.
  const auto params = cache.codec_params(0, 0);
  const auto key_params = params.first;
  const auto value_params = params.second;
  std::vector<float> decoded(static_cast<std::size_t>(tokens) * d);
  std::vector<float> summaries(static_cast<std::size_t>(pages) * 2 * d);
  std::vector<const float*> summary_of(pages);
  std::vector<const std::byte*> payloads(pages);
  for (index_t p = 0; p < pages; ++p) {
    payloads[p] = cache.pool().payload(ids[p]);
    float* page_keys = decoded.data() + static_cast<std::size_t>(p) * page_size * d;
    cache.quantizer().key.decode(quant::PageGeometry{page_size, d}, payloads[p], key_params, page_keys);
    float* summary = summaries.data() + static_cast<std::size_t>(p) * 2 * d;
    select::summarize_page(page_keys, nullptr, page_size, d, summary, summary + d);
    summary_of[p] = summary;
  }
  std::vector<float> head_bounds(static_cast<std::size_t>(group) * pages), page_bounds(pages);
  select::group_page_bounds(queries, group, d, summary_of, head_bounds, page_bounds);

  using KeyCodec = quant::Q4_0::key_codec;
  using ValueCodec = quant::Q4_0::value_codec;
  const auto kernel_set = kernels::KernelSet<KeyCodec, ValueCodec>::selected();
  // Attends `read` pages with the kernel; returns the bound and the true unread mass per head.
  const auto run = [&](const std::vector<index_t>& read) {
    std::vector<const std::byte*> selected;
    std::vector<index_t> unread(pages, page_size);
    for (index_t p : read) {
      selected.push_back(payloads[p]);
      unread[p] = 0;
    }
    kernels::Workspace workspace;
    workspace.prepare(group, d, page_size, 0);
    const kernels::PageRun run_pages{selected.data(), nullptr, static_cast<index_t>(selected.size()), 0, page_size, d,
                                     cache.value_plane_offset(), cache.page_format_info().payload_bytes};
    std::vector<float> out(static_cast<std::size_t>(group) * d);
    kernels::attend_stream<KeyCodec, ValueCodec>(run_pages, key_params, value_params, kernels::TailView{},
                                                 queries.data(), group, out.data(), workspace, kernel_set);
    std::vector<select::UnreadBound> bounds(group);
    select::unread_bounds(head_bounds, unread, std::span<const float>(workspace.running_max(), group),
                          std::span<const float>(workspace.running_sum(), group), 1.0f, bounds);
    std::vector<std::pair<double, double>> result;  // (bound, true mass) per head
    for (index_t h = 0; h < group; ++h) {
      std::vector<double> read_scores, unread_scores;
      for (index_t t = 0; t < tokens; ++t) {
        const double s = dot(queries.data() + h * d, decoded.data() + static_cast<std::size_t>(t) * d, d);
        (unread[t / page_size] == 0 ? read_scores : unread_scores).push_back(s);
      }
      result.emplace_back(bounds[h].mass, 1.0 / (1.0 + std::exp(log_sum_exp(read_scores) - log_sum_exp(unread_scores))));
    }
    return result;
  };

  std::vector<index_t> chosen(4);
  REQUIRE(select::select_top_pages(page_bounds, 4, chosen) == 4);
  CHECK(chosen == std::vector<index_t>{needle_page[0], needle_page[1], needle_page[2], needle_page[3]});
  const auto with_needles = run(chosen);
  const auto without_needles = run({0, 2, 4, 6});
  for (index_t h = 0; h < group; ++h) {
    INFO("head " << h << ": needles read: bound " << with_needles[h].first << " true " << with_needles[h].second
                 << "; needles skipped: bound " << without_needles[h].first << " true " << without_needles[h].second);
    CHECK(with_needles[h].first >= with_needles[h].second);
    CHECK(with_needles[h].first < 1e-3);  // certified: nothing this head needs was skipped
    CHECK(without_needles[h].first >= without_needles[h].second);
    CHECK(without_needles[h].second > 0.5);
    CHECK(select::UnreadBound{without_needles[h].first, 0.0}.fired(0.5));
  }
}

TEST_CASE("Quest bound: a NaN query gives its pages a NaN bound, so they are read, in every variant",
          "[quest][select]") {
  // check_inputs = false lets a NaN query through; std::max(-inf, NaN) used to give -inf, a page
  // ranked last and never read, where ranks_before reads a NaN bound as +inf.
  select::detail::for_each_page_bounds_variant([&](const char* name, select::detail::PageBoundsFunction bounds_of) {
    const index_t d = 64, pages = 5, page_size = 16;
    std::vector<std::vector<float>> summaries(pages, std::vector<float>(2 * d));
    std::vector<const float*> pointers(pages);
    for (index_t p = 0; p < pages; ++p) {
      const std::vector<float> keys = test::random_rows(page_size, d, 1000 + p);
      select::summarize_page(keys.data(), nullptr, page_size, d, summaries[p].data(), summaries[p].data() + d);
      pointers[p] = summaries[p].data();
    }
    for (const index_t group : {1, 4}) {
      std::vector<float> queries = test::random_rows(group, d, 1100);
      queries[3] = std::nanf("");  // head 0
      std::vector<float> head_bounds(static_cast<std::size_t>(group) * pages), page_bounds(pages);
      bounds_of(queries.data(), group, d, pointers.data(), pages, head_bounds.data(), page_bounds.data(),
                select::GroupBound::kMax);
      for (index_t p = 0; p < pages; ++p) {
        INFO(name << " group " << group << " page " << p);
        CHECK(std::isnan(page_bounds[p]));
      }
    }
  });
}
