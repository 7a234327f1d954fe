// KVQuant (quant/kvquant.hpp, quant/nuq.hpp, quant/kvquant_calibration.hpp): the normal-float
// codebook against QLoRA's published NF4 table, k-means against its objective, the calibration's
// quantiles against a sort computed here, and both planes' round trips against bounds from the
// codebook's gaps and fp16 rounding.

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <random>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "quant_test_support.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;
using kvpack_test::quant::fp16_store_error_bound;

/// The largest distance from a point of [−1, 1] to its nearest level.
double max_half_gap(const quant::nuq::Codebook& book) {
  double gap = std::max(1.0 + book.levels[0], 1.0 - book.levels[book.size - 1]);
  for (int i = 1; i < book.size; ++i) gap = std::max(gap, 0.5 * (book.levels[i] - book.levels[i - 1]));
  return gap;
}

/// How far a normalised element can end from its decoded level: half the largest gap of the
/// levels it is rounded to, plus (Q-Norm) the largest move of a level between rounding and
/// decoding.
double max_decode_error(const std::vector<quant::nuq::Codebook>& decoded, const std::vector<quant::nuq::Codebook>& rounded) {
  if (rounded.empty()) return max_half_gap(decoded[0]);
  double shift = 0.0;
  for (int i = 0; i < decoded[0].size; ++i) shift = std::max(shift, std::fabs(double{decoded[0].levels[i]} - rounded[0].levels[i]));
  return max_half_gap(rounded[0]) + shift;
}

/// Tables calibrated on `tokens` random tokens like those the tests then encode.
using QNorm = quant::KVQuantCalibrator::Options::QNorm;

std::shared_ptr<const quant::KVQuantTables> calibrate(int bits, index_t head_dim, std::uint32_t seed,
                                                      double fraction = 0.01, bool kmeans = true,
                                                      QNorm q_norm = QNorm::kNever) {
  const ModelShape shape{1, 1, 1, head_dim};
  quant::KVQuantCalibrator calibrator(shape, {bits, fraction, kmeans, 50, 1, q_norm});
  const auto keys = test::random_rows(512, head_dim, seed, 4, 8.0f);
  const auto values = test::random_rows(512, head_dim, seed + 1);
  calibrator.add(0, keys, values);
  return calibrator.finish();
}

}  // namespace

TEST_CASE("the inverse normal CDF and the NF4 codebook match published values", "[quant][kvquant]") {
  CHECK(quant::nuq::inverse_normal_cdf(0.5) == Approx(0.0).margin(1e-12));
  CHECK(quant::nuq::inverse_normal_cdf(0.975) == Approx(1.959963984540054).epsilon(1e-12));
  CHECK(quant::nuq::inverse_normal_cdf(0.001) == Approx(-3.090232306167813).epsilon(1e-10));
  // QLoRA's NF4 (bitsandbytes' published table), the same construction.
  const double nf4[] = {-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0};
  const auto book = quant::nuq::normal_float_codebook(4);
  REQUIRE(book.size == 16);
  for (int i = 0; i < 16; ++i) CHECK(book.levels[i] == Approx(nf4[i]).margin(1e-6));
  for (int bits : {2, 3}) {
    const auto small = quant::nuq::normal_float_codebook(bits);
    REQUIRE(small.size == 1 << bits);
    CHECK(small.levels[0] == -1.0f);
    CHECK(small.levels[small.size - 1] == 1.0f);
    CHECK(std::count(small.levels.begin(), small.levels.begin() + small.size, 0.0f) == 1);
    CHECK(std::is_sorted(small.levels.begin(), small.levels.begin() + small.size));
  }
}

TEST_CASE("nearest_level rounds to the nearest level", "[quant][kvquant]") {
  const auto book = quant::nuq::normal_float_codebook(3);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uniform(-1.2f, 1.2f);
  for (int i = 0; i < 10000; ++i) {
    const float x = uniform(rng);
    const int code = quant::nuq::nearest_level(book, x);
    for (int k = 0; k < book.size; ++k) REQUIRE(std::fabs(x - book.levels[code]) <= std::fabs(x - book.levels[k]));
  }
}

TEST_CASE("k-means finds clustered levels and never does worse than its start", "[quant][kvquant]") {
  // Four tight clusters and 2 bits: the levels are the cluster means.
  std::vector<float> samples;
  std::mt19937 rng(6);
  std::normal_distribution<float> jitter(0.0f, 0.001f);
  const float centres[] = {-0.8f, -0.1f, 0.3f, 0.9f};
  for (int i = 0; i < 4000; ++i) samples.push_back(centres[i % 4] + jitter(rng));
  const auto book = quant::nuq::kmeans_codebook(2, samples);
  for (int k = 0; k < 4; ++k) CHECK(book.levels[k] == Approx(centres[k]).margin(3e-4));

  // On Gaussian-like data the weighted objective does not increase from the NF start.
  std::normal_distribution<float> normal(0.0f, 0.35f);
  std::vector<float> data, weights;
  for (int i = 0; i < 20000; ++i) {
    data.push_back(std::clamp(normal(rng), -1.0f, 1.0f));
    weights.push_back(0.5f + static_cast<float>(i % 7));
  }
  auto objective = [&](const quant::nuq::Codebook& b) {
    double sum = 0.0;
    for (std::size_t i = 0; i < data.size(); ++i) {
      const double e = data[i] - b.levels[quant::nuq::nearest_level(b, data[i])];
      sum += weights[i] * e * e;
    }
    return sum;
  };
  for (int bits : {2, 3, 4}) {
    const auto start = quant::nuq::normal_float_codebook(bits);
    const auto fitted = quant::nuq::kmeans_codebook(bits, data, weights);
    CHECK(objective(fitted) <= objective(start));
    CHECK(std::is_sorted(fitted.levels.begin(), fitted.levels.begin() + fitted.size));
  }
  // Zero weights remove samples.
  std::vector<float> mixed = samples, mixed_weights(samples.size(), 1.0f);
  for (int i = 0; i < 1000; ++i) {
    mixed.push_back(0.55f);
    mixed_weights.push_back(0.0f);
  }
  const auto weighted = quant::nuq::kmeans_codebook(2, mixed, mixed_weights);
  for (int k = 0; k < 4; ++k) CHECK(weighted.levels[k] == Approx(book.levels[k]).margin(1e-6));
}

TEST_CASE("calibration takes the f/2 and 1 - f/2 quantiles and skips the sink token", "[quant][kvquant]") {
  const index_t d = 16;
  const ModelShape shape{2, 2, 2, d};
  quant::KVQuantCalibrator calibrator(shape, {3, 0.02, false, 50, 1});
  auto keys = test::random_rows(301 * 2, d, 9, 2, 6.0f);
  const auto values = test::random_rows(301 * 2, d, 10);
  for (index_t c = 0; c < 2 * d; ++c) keys[c] = 1e4f;  // token 0: the sink, left out
  calibrator.add(1, keys, values);
  calibrator.add(0, keys, values);
  const auto tables = calibrator.finish();
  for (index_t hc = 0; hc < 2 * d; ++hc) {
    std::vector<double> channel;
    for (std::size_t t = 1; t < 301; ++t) channel.push_back(keys[t * 2 * d + hc]);
    std::sort(channel.begin(), channel.end());
    auto q = [&](double p) {  // linear interpolation between order statistics
      const double at = p * (channel.size() - 1);
      const std::size_t i = static_cast<std::size_t>(at);
      return channel[i] + (at - i) * (channel[std::min(i + 1, channel.size() - 1)] - channel[i]);
    };
    const double lo = q(0.01), hi = q(0.99);
    CHECK(tables->key_offset[d * 2 + hc] == Approx(0.5 * (hi + lo)).margin(1e-5));
    CHECK(tables->key_half_range[d * 2 + hc] == Approx(0.5 * (hi - lo)).epsilon(1e-5));
  }
  CHECK(tables->key_codebook[0] == quant::nuq::normal_float_codebook(3));

  quant::KVQuantCalibrator empty(shape, {});
  empty.add(0, std::span<const float>(keys).first(2 * d), std::span<const float>(values).first(2 * d));
  CHECK_THROWS_AS(empty.finish(), Error);  // only a sink token: nothing left
  CHECK_THROWS_AS(empty.add(2, keys, values), Error);
  std::vector<float> bad = values;
  bad[3] = NAN;
  CHECK_THROWS_AS(empty.add(0, keys, bad), Error);
}

TEMPLATE_TEST_CASE("KVQuant planes round-trip within the codebook's gaps; outliers are exact",
                   "[quant][kvquant]", (std::integral_constant<int, 2>), (std::integral_constant<int, 3>),
                   (std::integral_constant<int, 4>)) {
  constexpr int kBits = TestType::value;
  for (const quant::PageGeometry g : {quant::PageGeometry{16, 32}, quant::PageGeometry{32, 128}, quant::PageGeometry{64, 64}}) {
    const auto tables = calibrate(kBits, g.head_dim, 21);
    const quant::KVQuant<kBits> q(tables, 0.01);
    const auto key_params = q.key.initial_params(0, 0);
    const auto value_params = q.value.initial_params(0, 0);
    auto keys = test::random_rows(g.page_size, g.head_dim, 31, 4, 8.0f);
    auto values = test::random_rows(g.page_size, g.head_dim, 32);
    keys[5] = 500.0f;  // far outside every calibrated range
    values[g.head_dim + 2] = -300.0f;
    std::vector<std::byte> kplane(q.key.plane_bytes(g)), vplane(q.value.plane_bytes(g));
    q.key.encode(g, keys.data(), g.head_dim, key_params, kplane.data());
    q.value.encode(g, values.data(), g.head_dim, value_params, vplane.data());
    std::vector<float> k_out(keys.size()), v_out(values.size());
    q.key.decode(g, kplane.data(), key_params, k_out.data());
    q.value.decode(g, vplane.data(), value_params, v_out.data());

    const std::size_t capacity = static_cast<std::size_t>(std::llround(0.01 * g.page_size * g.head_dim));
    CHECK(kplane.size() == static_cast<std::size_t>(g.page_size) * g.head_dim * kBits / 8 + 2 + 4 * capacity);
    CHECK(vplane.size() == static_cast<std::size_t>(g.page_size) * (g.head_dim * kBits / 8 + 4) + 2 + 4 * capacity);
    std::uint16_t key_outliers = 0, value_outliers = 0;
    std::memcpy(&key_outliers, kplane.data() + quant::KVQuantKeyCodec<kBits>::outliers_offset(g), 2);
    std::memcpy(&value_outliers, vplane.data() + quant::KVQuantValueCodec<kBits>::outliers_offset(g), 2);
    CHECK(key_outliers <= capacity);
    CHECK(value_outliers <= capacity);
    if (capacity > 0) {
      CHECK(k_out[5] == Approx(500.0f).epsilon(1e-3));  // kept: the furthest outside
      CHECK(v_out[g.head_dim + 2] == Approx(-300.0f).epsilon(1e-3));
    }

    const double key_gap = max_decode_error(tables->key_codebook, tables->key_encode_codebook);
    const double value_gap = max_decode_error(tables->value_codebook, tables->value_encode_codebook);
    kvpack_test::quant::Mismatches bad;
    for (index_t t = 0; t < g.page_size; ++t) {
      float lo = INFINITY, hi = -INFINITY;
      for (index_t c = 0; c < g.head_dim; ++c) {
        const std::size_t i = static_cast<std::size_t>(t) * g.head_dim + c;
        const double x = keys[i], r = tables->key_half_range[c], z = tables->key_offset[c];
        const bool exact = std::fabs(k_out[i] - x) <= fp16_store_error_bound(x);
        // In range: within the nearest level's gap; out of range and not kept: clamped to the
        // range's end, so within the gap of the edge level plus the distance outside.
        const double outside = std::max(0.0, std::fabs(x - z) - r);
        if (!exact && std::fabs(k_out[i] - x) > key_gap * r + outside + 1e-5 * (1 + std::fabs(x))) {
          bad.add("key t=" + std::to_string(t) + " c=" + std::to_string(c));
        }
        lo = std::min(lo, values[i]);
        hi = std::max(hi, values[i]);
      }
      // Values: each token's range covers its non-outliers; the range is stored in fp16.
      const double r = 0.5 * (hi - lo), z = 0.5 * (hi + lo);
      const double slop = fp16_store_error_bound(z) + fp16_store_error_bound(r) * 2;
      for (index_t c = 0; c < g.head_dim; ++c) {
        const std::size_t i = static_cast<std::size_t>(t) * g.head_dim + c;
        if (std::fabs(v_out[i] - values[i]) > value_gap * r + slop + 1e-5) {
          bad.add("value t=" + std::to_string(t) + " c=" + std::to_string(c));
        }
      }
    }
    kvpack_test::quant::report(bad);
  }
}

TEST_CASE("KVQuant's bits per element follow the documented formula", "[quant][kvquant]") {
  // The spec's accounting (ALGORITHMS.md §0/§2): nuq3 with 1 % outliers ≈ 3.32–3.35 bits. Here the
  // key plane at a 256-token page: 3 + (32 · C + 16) / (P · d), C = round(0.01 · P · d).
  const quant::PageGeometry g{256, 128};
  const auto tables = calibrate(3, 128, 41);
  const quant::KVQuant<3> q(tables, 0.01);
  const double key_bits = 8.0 * static_cast<double>(q.key.plane_bytes(g)) / (g.page_size * g.head_dim);
  const double capacity = std::round(0.01 * g.page_size * g.head_dim);
  CHECK(key_bits == Approx(3.0 + (32.0 * capacity + 16.0) / (g.page_size * g.head_dim)));
  CHECK(key_bits >= 3.32);
  CHECK(key_bits <= 3.35);
  // Values add an fp16 offset and half-range per token of one KV head: 32/d more.
  const double value_bits = 8.0 * static_cast<double>(q.value.plane_bytes(g)) / (g.page_size * g.head_dim);
  CHECK(value_bits == Approx(key_bits + 32.0 / 128).epsilon(1e-12));
}

TEST_CASE("a KVQuant cache without a matching calibration is rejected", "[quant][kvquant][errors]") {
  const ModelShape shape{2, 4, 2, 32};
  CHECK_THROWS_MATCHES((KVCache<layout::GQA, quant::KVQuant<3>>(shape)), Error,
                       Catch::Matchers::Predicate<Error>([](const Error& e) {
                         return e.code() == ErrorCode::kInvalidConfig &&
                                std::string(e.what()).find("KVQuantCalibrator") != std::string::npos;
                       }));
  const auto one_layer = calibrate(3, 32, 51);  // 1 layer x 1 KV head
  CHECK_THROWS_AS((KVCache<layout::GQA, quant::KVQuant<3>>(shape, {}, quant::KVQuant<3>(one_layer))), Error);
  CHECK_THROWS_AS((KVCache<layout::GQA, quant::KVQuant<4>>(ModelShape{1, 1, 1, 32}, {}, quant::KVQuant<4>(
                                                                                           one_layer))),
                  Error);  // 3-bit tables for a 4-bit codec
  CHECK_THROWS_AS((KVCache<layout::GQA, quant::KVQuant<3>>(ModelShape{1, 1, 1, 32}, {},
                                                           quant::KVQuant<3>(one_layer, 0.2))),
                  Error);  // outlier fraction above 5 %

  // Tables for another model shape, though every index the cache asks for is inside them.
  quant::KVQuantCalibrator two_heads(ModelShape{1, 2, 2, 32}, {3, 0.01, false, 50, 1, QNorm::kNever});
  const auto keys = test::random_rows(2 * 64, 32, 52);
  two_heads.add(0, keys, keys);
  CHECK_THROWS_WITH((KVCache<layout::GQA, quant::KVQuant<3>>(ModelShape{1, 1, 1, 32}, {},
                                                             quant::KVQuant<3>(two_heads.finish()))),
                    Catch::Contains("1 layers x 2 KV heads") && Catch::Contains("model has 1 x 1"));
  // The codec must keep the share of outliers the ranges were fitted without.
  CHECK_NOTHROW((KVCache<layout::GQA, quant::KVQuant<3>>(ModelShape{1, 1, 1, 32}, {},
                                                         quant::KVQuant<3>(calibrate(3, 32, 51, 0.02), 0.02))));
  CHECK_THROWS_WITH((KVCache<layout::GQA, quant::KVQuant<3>>(ModelShape{1, 1, 1, 32}, {},
                                                             quant::KVQuant<3>(calibrate(3, 32, 51, 0.02)))),
                    Catch::Contains("calibrated leaving out 0.02"));
}

TEST_CASE("KVQuant tables built by hand are checked before any codec indexes them", "[quant][kvquant][errors]") {
  const ModelShape shape{1, 1, 1, 32};
  const auto good = calibrate(3, 32, 51);  // 1 layer x 1 KV head
  REQUIRE_NOTHROW((KVCache<layout::GQA, quant::KVQuant<3>>(shape, {}, quant::KVQuant<3>(good))));
  const auto rejected = [&](auto edit) {
    auto tables = std::make_shared<quant::KVQuantTables>(*good);
    edit(*tables);
    try {
      KVCache<layout::GQA, quant::KVQuant<3>> cache(shape, {}, quant::KVQuant<3>(tables));
    } catch (const Error& error) {
      return error.code() == ErrorCode::kInvalidConfig && std::string(error.what()).find("KVQuantTables") != std::string::npos;
    }
    return false;
  };
  CHECK(rejected([](quant::KVQuantTables& t) { t.key_offset.clear(); }));
  CHECK(rejected([](quant::KVQuantTables& t) { t.key_half_range[3] = 0.0f; }));
  CHECK(rejected([](quant::KVQuantTables& t) { t.key_offset[0] = std::nanf(""); }));
  CHECK(rejected([](quant::KVQuantTables& t) { t.value_codebook.clear(); }));
  CHECK(rejected([](quant::KVQuantTables& t) { t.key_codebook[0].size = 16; }));  // 3 bits: 8 levels
  CHECK(rejected([](quant::KVQuantTables& t) { std::swap(t.key_codebook[0].levels[0], t.key_codebook[0].levels[7]); }));
  CHECK(rejected([](quant::KVQuantTables& t) { t.value_codebook[0].levels[2] = INFINITY; }));

  // Geometries the planes cannot hold, refused by the codecs themselves (a cache refuses pages
  // that are not multiples of 16 first): 12 tokens do not pack 8 at a time, and a row of 8192
  // channels would overrun the value encoder's scratch of 4096.
  using Keys = quant::KVQuantKeyCodec<3>;
  using Values = quant::KVQuantValueCodec<3>;
  for (const quant::PageGeometry bad : {quant::PageGeometry{12, 128}, quant::PageGeometry{8, 8192}}) {
    CHECK_THROWS_AS(Keys::validate_geometry(bad, 0.01), Error);
    CHECK_THROWS_AS(Values::validate_geometry(bad, 0.01), Error);
  }
  CHECK_NOTHROW(Values::validate_geometry({16, 4096}, 0.01));
}

namespace {

/// The calibration samples a test computes itself: normalised elements and their k-means weights.
struct Samples {
  std::vector<float> x, weight;
  void add(float value, double half_range, bool range_weighted) {
    x.push_back(value);
    weight.push_back(range_weighted ? static_cast<float>(half_range * half_range) : 1.0f);
  }
};

/// Keys as the key codec normalises a page of `tokens` rows (stride `row`) with the tables'
/// ranges: the round(f·tokens·d) elements furthest outside their range (ties: lower index) are
/// exact and left out, the others clamped to [−1, 1]. Written with a sort, not the codec's heap.
void page_key_samples(const float* page, std::size_t row, std::size_t tokens, index_t d, const float* offset,
                      const float* half_range, double fraction, bool range_weighted, Samples& out) {
  std::vector<std::pair<float, std::size_t>> outside;  // (excess, index)
  auto normalised = [&](std::size_t i) { return (page[(i / d) * row + i % d] - offset[i % d]) / half_range[i % d]; };
  for (std::size_t i = 0; i < tokens * d; ++i) {
    if (std::fabs(normalised(i)) - 1.0f > 0.0f) outside.push_back({std::fabs(normalised(i)) - 1.0f, i});
  }
  std::sort(outside.begin(), outside.end(),
            [](auto a, auto b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
  outside.resize(std::min<std::size_t>(outside.size(), std::llround(fraction * tokens * d)));
  std::vector<bool> exact(tokens * d, false);
  for (const auto& o : outside) exact[o.second] = true;
  for (std::size_t i = 0; i < tokens * d; ++i) {
    if (!exact[i]) out.add(std::clamp(normalised(i), -1.0f, 1.0f), half_range[i % d], range_weighted);
  }
}

/// Values as the value codec stores a page: encoded by the codec, then each element normalised by
/// the fp16 offset and half-range the plane holds, the elements in its outlier section left out.
void page_value_samples(const quant::KVQuantValueCodec<3>& codec, const float* page, std::size_t row,
                        std::size_t tokens, index_t d, bool range_weighted, Samples& out) {
  using quant::kvquant_detail::get_u16;
  const quant::PageGeometry g{static_cast<index_t>(tokens), d};
  std::vector<std::byte> plane(codec.plane_bytes(g));
  codec.encode(g, page, static_cast<std::ptrdiff_t>(row), codec.initial_params(0, 0), plane.data());
  const std::byte* section = plane.data() + codec.outliers_offset(g);
  std::vector<bool> exact(tokens * d, false);
  for (std::size_t i = 0; i < get_u16(section); ++i) exact[get_u16(section + 2 + 2 * i)] = true;
  for (std::size_t t = 0; t < tokens; ++t) {
    const float offset = half::from_bits(get_u16(plane.data() + codec.offsets_offset(g) + 2 * t));
    const float half_range = half::from_bits(get_u16(plane.data() + codec.ranges_offset(g) + 2 * t));
    for (index_t c = 0; c < d; ++c) {
      if (exact[t * d + c] || !(half_range > 0.0f)) continue;
      out.add(std::clamp((page[t * row + c] - offset) / half_range, -1.0f, 1.0f), half_range, range_weighted);
    }
  }
}

}  // namespace

TEST_CASE("calibrated codebooks fit the elements as pages store them, weighted by range squared", "[quant][kvquant]") {
  const index_t d = 64, heads = 2, P = 32;
  const std::size_t row = static_cast<std::size_t>(heads) * d;
  const ModelShape shape{1, 2, heads, d};
  // Two sequences whose lengths after the sink are not multiples of the page; token scales 1 to
  // 10 so that the range weights matter, heavy channels so that pages run out of outlier room.
  std::vector<std::vector<float>> keys, values;
  for (auto [tokens, seed] : {std::pair<std::size_t, std::uint32_t>{78, 3}, {51, 4}}) {
    keys.push_back(test::random_rows(tokens, static_cast<int>(row), seed, 6, 6.0f));
    values.push_back(test::random_rows(tokens, static_cast<int>(row), seed + 10));
    for (std::size_t t = 0; t < tokens; ++t) {
      for (std::size_t i = 0; i < row; ++i) values.back()[t * row + i] *= 1.0f + static_cast<float>(t % 10);
    }
  }
  std::vector<quant::nuq::Codebook> fitted[2];
  for (bool range_weighted : {true, false}) {
    quant::KVQuantCalibrator::Options options{3, 0.01, true, 50, 1};
    options.page_size = P;
    options.range_weighted = range_weighted;
    quant::KVQuantCalibrator calibrator(shape, options);
    for (std::size_t s = 0; s < keys.size(); ++s) calibrator.add(0, keys[s], values[s]);
    const auto tables = calibrator.finish();
    const quant::KVQuant<3> codec(tables, 0.01);
    Samples key_samples, value_samples;
    for (std::size_t s = 0; s < keys.size(); ++s) {
      const std::size_t tokens = keys[s].size() / row - 1;  // after the sink
      for (std::size_t first = 0; first < tokens; first += P) {
        const std::size_t n = std::min<std::size_t>(P, tokens - first);
        for (std::size_t h = 0; h < static_cast<std::size_t>(heads); ++h) {
          const std::size_t at = (1 + first) * row + h * d;
          page_key_samples(keys[s].data() + at, row, n, d, tables->key_offset.data() + h * d,
                           tables->key_half_range.data() + h * d, 0.01, range_weighted, key_samples);
          page_value_samples(codec.value, values[s].data() + at, row, n, d, range_weighted, value_samples);
        }
      }
    }
    const auto key_book = quant::nuq::kmeans_codebook(3, key_samples.x, key_samples.weight, 50);
    const auto value_book = quant::nuq::kmeans_codebook(3, value_samples.x, value_samples.weight, 50);
    for (int i = 0; i < 8; ++i) {
      CHECK(tables->key_codebook[0].levels[i] == Approx(key_book.levels[i]).margin(1e-6));
      CHECK(tables->value_codebook[0].levels[i] == Approx(value_book.levels[i]).margin(1e-6));
    }
    fitted[range_weighted ? 0 : 1] = {tables->key_codebook[0], tables->value_codebook[0]};
  }
  // The range weights change the levels on this data (tokens of ten different scales).
  CHECK_FALSE(fitted[0][1] == fitted[1][1]);
}

TEST_CASE("KVQuantCalibrator rejects options it cannot honour", "[quant][kvquant][errors]") {
  using Options = quant::KVQuantCalibrator::Options;
  CHECK_THROWS_AS(quant::KVQuantCalibrator(ModelShape{1, 1, 1, 4}, Options{}), Error);  // head_dim not 8k
  Options negative_skip;
  negative_skip.skip_first_tokens = -1;
  CHECK_THROWS_AS(quant::KVQuantCalibrator(ModelShape{1, 1, 1, 32}, negative_skip), Error);
  Options no_rounds;
  no_rounds.max_iterations = 0;
  CHECK_THROWS_AS(quant::KVQuantCalibrator(ModelShape{1, 1, 1, 32}, no_rounds), Error);
  for (index_t page_size : {0, 12, 20, 4096}) {  // not a page the codecs store (4096 · 32 > 65536)
    Options bad_page;
    bad_page.page_size = page_size;
    CHECK_THROWS_AS(quant::KVQuantCalibrator(ModelShape{1, 1, 1, 32}, bad_page), Error);
  }
}

TEST_CASE("Q-Norm keeps the mean and spread of the calibration samples at 2 bits", "[quant][kvquant]") {
  const index_t d = 64;
  const auto tables = calibrate(2, d, 77, 0.01, true, QNorm::kTwoBit);
  REQUIRE(tables->key_encode_codebook.size() == 1);
  REQUIRE(tables->value_encode_codebook.size() == 1);
  // The calibration keys again (calibrate's own generator and seed), normalised by the tables'
  // ranges page by page as the calibrator does (the first token is the skipped sink).
  const auto keys = test::random_rows(512, d, 77, 4, 8.0f);
  Samples samples;
  for (std::size_t first = 0; first < 511; first += 32) {
    page_key_samples(keys.data() + (1 + first) * d, d, std::min<std::size_t>(32, 511 - first), d,
                     tables->key_offset.data(), tables->key_half_range.data(), 0.01, false, samples);
  }
  double sum = 0, sum_sq = 0, decoded_sum = 0, decoded_sq = 0, n = 0;
  for (float x : samples.x) {
    const int code = quant::nuq::nearest_level(tables->key_encode_codebook[0], x);
    const double decoded = tables->key_codebook[0].levels[code];
    sum += x;
    sum_sq += double{x} * x;
    decoded_sum += decoded;
    decoded_sq += decoded * decoded;
    n += 1;
  }
  const double mean = sum / n, decoded_mean = decoded_sum / n;
  const double sd = std::sqrt(sum_sq / n - mean * mean), decoded_sd = std::sqrt(decoded_sq / n - decoded_mean * decoded_mean);
  CHECK(decoded_mean == Approx(mean).margin(1e-4));
  CHECK(decoded_sd == Approx(sd).epsilon(1e-4));
  // The codec rounds to the original levels and decodes to the corrected ones (an element it
  // keeps as an outlier comes back as its fp16 value instead).
  const quant::KVQuant<2> q(tables, 0.01);
  const quant::PageGeometry g{32, d};
  const auto params = q.key.initial_params(0, 0);
  std::vector<std::byte> plane(q.key.plane_bytes(g));
  std::vector<float> decoded(static_cast<std::size_t>(32) * d);
  q.key.encode(g, keys.data() + d, d, params, plane.data());
  q.key.decode(g, plane.data(), params, decoded.data());
  int mismatches = 0;
  for (index_t t = 0; t < 32; ++t) {
    for (index_t c = 0; c < d; ++c) {
      const float x = keys[static_cast<std::size_t>(t + 1) * d + c];
      const float normalised = (x - tables->key_offset[c]) / tables->key_half_range[c];
      if (std::fabs(normalised) > 1.0f) continue;
      const int code = quant::nuq::nearest_level(tables->key_encode_codebook[0], normalised);
      const double expected = double{tables->key_codebook[0].levels[code]} * tables->key_half_range[c] + tables->key_offset[c];
      const double got = decoded[static_cast<std::size_t>(t) * d + c];
      const bool as_level = std::fabs(got - expected) <= 1e-5 * (1.0 + std::fabs(expected));
      const bool as_outlier = got == static_cast<float>(kvpack::half(x));
      if (!as_level && !as_outlier) ++mismatches;
    }
  }
  CHECK(mismatches == 0);
  // kTwoBit leaves 3 bits alone, and the default is off.
  CHECK(calibrate(3, d, 77, 0.01, true, QNorm::kTwoBit)->key_encode_codebook.empty());
  CHECK(calibrate(2, d, 77)->key_encode_codebook.empty());
}
