// The CUDA decode-attention kernels against the scalar reference (kernels/reference.hpp) on the
// same page bytes, for every codec the device reads: several streams of different lengths in one
// launch (pages not filling a split, tail rows only, hundreds of pages), outlier channels, zero
// rows, values far outside the rest, GQA groups of 1 to 12 (two head passes), NaN pages; which of
// the two kernels (tensor cores for fp16 and q4_0, generic otherwise) a launch takes; and pages
// encoded on the device, byte for byte against the host encoders (KVQuant's with its outliers
// capped); tokens appended to a mirrored layer on the device next to the host cache taking the
// same ones; a cache created on the device (DeviceKVCache) beside a host twin: pages, read_back
// and attention after prefills, appends, adopt, forks and FP8 scales calibrated from the data,
// and a decode on a non-blocking stream that nothing synchronises. TurboQuant-MSE is read in its rotated space, with the rotations' own
// rounding added to the bound. Without a GPU the binary exits with CTest's skip code (77) and
// says why.

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <limits>
#include <memory>
#include <vector>

#include "kvpack/kernels/cuda/device_cache.cuh"
#include "kvpack/kernels/cuda/device_layer.cuh"
#include "kvpack/kernels/reference.hpp"
#include "kvpack/kvpack.hpp"
#include "support/expect_error.hpp"
#include "support/stream_fixture.hpp"

namespace {

using namespace kvpack;
namespace gpu = kvpack::kernels::cuda;
using test::expect_error;

struct StreamShape {
  index_t pages = 0;
  index_t tail = 0;
};

/// Adversarial rows for one stream: outlier key channels, a zero key row, one huge key element
/// and one huge value element (when the stream is long enough).
struct StreamData {
  std::vector<float> keys, values, queries;
};

StreamData make_stream_data(std::size_t rows, index_t head_dim, index_t group, std::uint32_t seed) {
  StreamData data{test::random_rows(rows, head_dim, seed, 4, 10.0f), test::random_rows(rows, head_dim, seed + 1),
                  test::random_rows(static_cast<std::size_t>(group), head_dim, seed + 2, 4, 3.0f)};
  if (rows > 9) {
    for (index_t c = 0; c < head_dim; ++c) data.keys[3 * head_dim + c] = 0.0f;
    data.keys[7 * head_dim + 1] = 900.0f;
    data.values[9 * head_dim + 2] = -400.0f;
  }
  for (float& q : data.queries) q /= std::sqrt(static_cast<float>(head_dim));
  return data;
}

/// Builds the streams on the host with the codecs' scalar encoders, runs one device launch over
/// all of them, and returns per stream (device output, reference output, bound).
template <class Quantizer>
struct DeviceRun {
  std::vector<std::unique_ptr<test::StreamFixture<Quantizer>>> fixtures;
  std::vector<StreamData> data;
  std::vector<float> device_out;
  index_t group = 0, head_dim = 0;
  bool tensor_cores = false;  ///< whether the launch ran on the tensor-core kernel

  DeviceRun(index_t page_size, index_t head_dim_, index_t group_, const std::vector<StreamShape>& shapes,
            std::uint32_t seed, void (*poison)(test::StreamFixture<Quantizer>&) = nullptr)
      : group(group_), head_dim(head_dim_) {
    std::size_t total_pages = 0;
    for (std::size_t s = 0; s < shapes.size(); ++s) {
      const std::size_t rows = static_cast<std::size_t>(shapes[s].pages) * page_size + shapes[s].tail;
      data.push_back(make_stream_data(rows, head_dim, group, seed + 10 * static_cast<std::uint32_t>(s)));
      fixtures.push_back(std::make_unique<test::StreamFixture<Quantizer>>(page_size, head_dim, shapes[s].pages,
                                                                          shapes[s].tail, data[s].keys, data[s].values));
      total_pages += static_cast<std::size_t>(shapes[s].pages);
    }
    if (poison != nullptr) poison(*fixtures.front());
    const auto& first = *fixtures.front();
    gpu::DevicePagePool pool({first.payload_bytes, 0}, std::max<std::size_t>(1, total_pages));
    gpu::DeviceLayer<typename Quantizer::key_codec, typename Quantizer::value_codec> layer(
        pool, group, page_size, head_dim, first.value_offset);
    std::vector<float> queries;
    for (std::size_t s = 0; s < fixtures.size(); ++s) {
      const auto& f = *fixtures[s];
      layer.add_stream(f.pages, f.key_params, f.value_params, f.tail_keys, f.tail_values);
      queries.insert(queries.end(), data[s].queries.begin(), data[s].queries.end());
    }
    REQUIRE(pool.pages_in_use() == total_pages);
    gpu::DeviceBuffer<float> device_queries{std::span<const float>(queries)};
    gpu::DeviceBuffer<float> out(queries.size());
    tensor_cores = layer.attends_on_tensor_cores();
    layer.attend(device_queries.data(), out.data());
    gpu::check(cudaDeviceSynchronize(), "attention");
    device_out = out.download();
  }

  [[nodiscard]] std::vector<float> reference(std::size_t s) const {
    const auto& f = *fixtures[s];
    std::vector<float> expected(static_cast<std::size_t>(group) * head_dim);
    kernels::reference::attend_stream(f.quantizer.key, f.quantizer.value, f.run(), f.key_params, f.value_params,
                                      f.tail(), data[s].queries.data(), group, expected.data());
    return expected;
  }
  [[nodiscard]] const float* output(std::size_t s) const {
    return device_out.data() + s * static_cast<std::size_t>(group) * head_dim;
  }
};

/// What TurboQuant-MSE adds on the device (element_decode.hpp's rotated_space), for one stream:
/// - keys: the kernel turns each query into the rotated space with M = Rᵀ in fp32, a chain of d
///   fused multiply-adds per channel that std::fmaf repeats here exactly, and scores the
///   decoder's rotated keys n·C. Each page score differs from q·k̂ by δ_t, computed here in double
///   from the same floats (M's rounding, the chain's and the decode's); the normalised weights
///   then move by a factor within e^{±2δ}, δ = max_t δ_t: 2(e^{2δ} − 1)·max|v̂| on the output.
/// - values: the pages' sums come back through M = R in fp32 (d products per channel), so each
///   output channel moves by at most (d + 1)·2⁻²⁴·max_c Σ_j |M_jc| · max|v'| (v' the decoder's
///   rotated values; the sums are weighted averages of them once normalised).
template <class Quantizer>
double rotation_error_bound(const test::StreamFixture<Quantizer>& f, const std::vector<float>& queries,
                            index_t group) {
  using KeyCodec = typename Quantizer::key_codec;
  using ValueCodec = typename Quantizer::value_codec;
  const quant::PageGeometry g = f.geometry;
  const index_t d = g.head_dim;
  const auto row_count = static_cast<std::size_t>(g.page_size) * d;
  std::vector<float> keys(row_count), values(row_count);
  double max_value = 0.0;
  for (float x : f.tail_values) max_value = std::max(max_value, static_cast<double>(std::fabs(x)));
  for (const std::byte* page : f.pages) {
    f.quantizer.value.decode(g, page + f.value_offset, f.value_params, values.data());
    for (float x : values) max_value = std::max(max_value, static_cast<double>(std::fabs(x)));
  }
  double bound = 0.0;
  if constexpr (gpu::rotated_space<gpu::ElementDecoder<KeyCodec>>) {
    const auto params = gpu::to_device_params(f.key_params, g, nullptr);
    const std::vector<float> M =
        gpu::turbo_transform(quant::turbo_detail::layer_view(f.key_params, d).rotation, d, Plane::kKey);
    double delta = 0.0;
    std::vector<float> turned(static_cast<std::size_t>(d));
    for (index_t h = 0; h < group; ++h) {
      const float* q = queries.data() + static_cast<std::size_t>(h) * d;
      for (index_t c = 0; c < d; ++c) {
        float sum = 0.0f;
        for (index_t j = 0; j < d; ++j) sum = std::fmaf(M[static_cast<std::size_t>(j) * d + c], q[j], sum);
        turned[c] = sum;
      }
      for (const std::byte* page : f.pages) {
        f.quantizer.key.decode(g, page, f.key_params, keys.data());
        for (index_t t = 0; t < g.page_size; ++t) {
          double device = 0.0, host = 0.0;
          for (index_t c = 0; c < d; ++c) {
            device += static_cast<double>(turned[c]) * gpu::ElementDecoder<KeyCodec>::at(page, g, params, t, c);
            host += static_cast<double>(q[c]) * keys[static_cast<std::size_t>(t) * d + c];
          }
          delta = std::max(delta, std::fabs(device - host));
        }
      }
    }
    if (max_value > 0.0) bound += 2.0 * std::expm1(2.0 * delta) * max_value;  // never Inf·0 = NaN
  }
  if constexpr (gpu::rotated_space<gpu::ElementDecoder<ValueCodec>>) {
    const auto params = gpu::to_device_params(f.value_params, g, nullptr);
    const std::vector<float> M =
        gpu::turbo_transform(quant::turbo_detail::layer_view(f.value_params, d).rotation, d, Plane::kValue);
    double column_mass = 0.0, rotated_max = 0.0;
    for (index_t c = 0; c < d; ++c) {
      double mass = 0.0;
      for (index_t j = 0; j < d; ++j) mass += std::fabs(M[static_cast<std::size_t>(j) * d + c]);
      column_mass = std::max(column_mass, mass);
    }
    for (const std::byte* page : f.pages) {
      for (index_t t = 0; t < g.page_size; ++t) {
        for (index_t c = 0; c < d; ++c) {
          const float v = gpu::ElementDecoder<ValueCodec>::at(page + f.value_offset, g, params, t, c);
          rotated_max = std::max(rotated_max, static_cast<double>(std::fabs(v)));
        }
      }
    }
    bound += (d + 1) * 0x1p-24 * (1.0 + 1e-3) * column_mass * rotated_max;
  }
  return bound;
}

/// Every stream within the fp32 bound of support/error_bound.hpp (the device computes in fp32,
/// in another order than the reference's double), plus the rotations' for TurboQuant.
/// Returns whether the launch ran on the tensor-core kernel.
template <class Quantizer>
bool check_against_reference(index_t page_size, index_t head_dim, index_t group, const std::vector<StreamShape>& shapes,
                             std::uint32_t seed) {
  const DeviceRun<Quantizer> run(page_size, head_dim, group, shapes, seed);
  for (std::size_t s = 0; s < shapes.size(); ++s) {
    const std::vector<float> expected = run.reference(s);
    const double bound =
        test::error_bound(*run.fixtures[s], run.data[s].queries, group, test::kCudaKernels, nullptr) +
        rotation_error_bound(*run.fixtures[s], run.data[s].queries, group);
    double worst = 0.0;
    for (std::size_t i = 0; i < expected.size(); ++i) {
      const double error = std::fabs(static_cast<double>(run.output(s)[i]) - expected[i]);
      worst = std::isnan(error) ? std::numeric_limits<double>::infinity() : std::max(worst, error);
    }
    INFO(Quantizer::name() << " page_size " << page_size << " head_dim " << head_dim << " group " << group
                           << " stream " << s << " (" << shapes[s].pages << " pages + " << shapes[s].tail
                           << " rows): error " << worst << ", bound " << bound);
    CHECK(worst <= bound);
  }
  return run.tensor_cores;
}

template <class Quantizer>
void check_quantizer() {
  // One launch, streams of very different lengths: a long one (many splits), one page, tail only,
  // pages plus a tail that is not a multiple of the page size.
  check_against_reference<Quantizer>(32, 128, 4, {{97, 31}, {1, 0}, {0, 7}, {40, 13}}, 100);
  check_against_reference<Quantizer>(64, 64, 1, {{9, 0}, {3, 50}}, 200);
  check_against_reference<Quantizer>(32, 96, 3, {{12, 5}}, 300);
  check_against_reference<Quantizer>(64, 128, 12, {{6, 1}, {30, 0}}, 400);  // two passes of 8 heads
  check_against_reference<Quantizer>(128, 64, 2, {{5, 100}}, 500);
  check_against_reference<Quantizer>(32, 128, 4, {{5, 0}, {3, 0}}, 600);  // no tail rows: tail_count is null
}

}  // namespace

TEST_CASE("CUDA attention matches the reference: Float<float|half|bfloat16>", "[cuda]") {
  check_quantizer<quant::Float<float>>();
  check_quantizer<quant::Float<kvpack::half>>();
  check_quantizer<quant::Float<kvpack::bfloat16>>();
}

TEST_CASE("CUDA attention matches the reference: FP8 E4M3FN and E5M2", "[cuda]") {
  check_quantizer<quant::FP8<quant::E4M3FN>>();
  check_quantizer<quant::FP8<quant::E5M2>>();
}

TEST_CASE("CUDA attention matches the reference: Int8, Q8_0, Q4_0", "[cuda]") {
  check_quantizer<quant::Int8>();
  check_quantizer<quant::Q8_0>();
  check_quantizer<quant::Q4_0>();
  check_against_reference<quant::Q4_0>(256, 128, 4, {{3, 200}}, 600);  // the largest page
}

TEST_CASE("fp16 and q4_0 run on tensor cores where their pages fit it, on the generic kernel elsewhere", "[cuda]") {
  using F16 = quant::Float<kvpack::half>;
  // The shapes of check_quantizer take the tensor-core kernel ...
  CHECK(check_against_reference<F16>(32, 128, 4, {{9, 31}}, 1000));
  CHECK(check_against_reference<quant::Q4_0>(64, 96, 3, {{7, 63}}, 1001));
  // ... pages that are not whole 32-token chunks, head_dim 256 and tails longer than 256 rows
  // do not, and still match the reference; nor do the codecs without tensor-core tiles.
  CHECK_FALSE(check_against_reference<F16>(16, 128, 4, {{9, 15}}, 1002));
  CHECK_FALSE(check_against_reference<quant::Q4_0>(32, 256, 2, {{5, 3}}, 1003));
  CHECK_FALSE(check_against_reference<F16>(32, 64, 2, {{2, 0}, {1, 300}}, 1004));
  CHECK_FALSE(check_against_reference<quant::Float<float>>(32, 128, 4, {{3, 1}}, 1005));
}

TEST_CASE("CUDA attention matches the reference: KIVI-2 and KIVI-4", "[cuda]") {
  check_quantizer<quant::KIVI<2, 32>>();
  check_quantizer<quant::KIVI<4, 32>>();
  check_against_reference<quant::KIVI<4, 64>>(64, 128, 4, {{20, 9}}, 700);
}

TEST_CASE("CUDA attention matches the reference: KVQuant-2, 3 and 4 with their exact outliers", "[cuda]") {
  // Calibrated per head_dim on other draws (support/stream_fixture.hpp); the keys' outlier
  // channels leave every page with exact outliers. The layer copies the calibrated key ranges to
  // the device (device_params.cuh).
  check_quantizer<quant::KVQuant<4>>();
  check_quantizer<quant::KVQuant<3>>();
  check_quantizer<quant::KVQuant<2>>();
}

TEST_CASE("CUDA attention matches the reference: TurboQuant-MSE, in its rotated space", "[cuda]") {
  // 4, 3.5 (sections of 4 and 3 bits), 3 (codes across bytes) and 2.5 bits; head_dim 96 takes
  // the dense rotation, the others a Hadamard one.
  check_quantizer<quant::TurboQuant<8>>();
  check_quantizer<quant::TurboQuant<7>>();
  check_quantizer<quant::TurboQuant<6>>();
  check_quantizer<quant::TurboQuant<5>>();
}

TEST_CASE("a layer's TurboQuant streams share one rotation matrix on the device", "[cuda]") {
  using Q = quant::TurboQuant<8>;
  const auto data = make_stream_data(2 * 32, 128, 1, 1700);
  const test::StreamFixture<Q> f(32, 128, 2, 0, data.keys, data.values);
  const quant::PageGeometry g{32, 128};
  gpu::DeviceParamTables tables;
  const auto first_key = tables.upload<Q::key_codec>(f.key_params, g);
  const auto second_key = tables.upload<Q::key_codec>(f.key_params, g);
  const auto value = tables.upload<Q::value_codec>(f.value_params, g);
  CHECK(tables.table_count() == 3);  // Rᵀ for keys, R's signs (the encoders'), R for values
  CHECK(first_key.transform == second_key.transform);
  CHECK(first_key.transform != value.transform);
  CHECK(first_key.rotation == value.rotation);
  tables.discard_from(2);  // the value matrix is gone, and a new upload sends it again
  const auto again = tables.upload<Q::value_codec>(f.value_params, g);
  CHECK(again.rotation == first_key.rotation);  // the signs were kept
  CHECK(tables.table_count() == 3);
}

TEST_CASE("a NaN in one stream's page poisons that stream only", "[cuda]") {
  using Q = quant::Float<kvpack::half>;
  const DeviceRun<Q> run(32, 64, 2, {{4, 3}, {5, 1}}, 800, [](test::StreamFixture<Q>& f) {
    // Key of token 5, channel 2 of the first page (channel-major fp16): a NaN.
    const std::uint16_t nan = 0x7E00;
    std::memcpy(const_cast<std::byte*>(f.pages[0]) + (2 * 32 + 5) * 2, &nan, 2);
  });
  for (index_t i = 0; i < 2 * 64; ++i) CHECK(std::isnan(run.output(0)[i]));
  const std::vector<float> expected = run.reference(1);
  const double bound = test::error_bound(*run.fixtures[1], run.data[1].queries, 2, test::kCudaKernels, nullptr);
  for (std::size_t i = 0; i < expected.size(); ++i) CHECK(std::fabs(run.output(1)[i] - expected[i]) <= bound);
}

TEST_CASE("pages of an odd number of slots are rejected with a clear error", "[cuda]") {
  CHECK_THROWS_MATCHES((DeviceRun<quant::Float<kvpack::half>>(17, 128, 4, {{2, 0}}, 901)), Error,
                       Catch::Matchers::Predicate<Error>([](const Error& e) {
                         return e.code() == ErrorCode::kUnsupported &&
                                std::string(e.what()).find("even page_size") != std::string::npos;
                       }));
}

TEST_CASE("pages too large for shared memory are rejected with a clear error", "[cuda]") {
  using Q = quant::Float<float>;  // 256 tokens x 128 channels x 4 bytes x 2 planes = 256 KiB a page
  CHECK_THROWS_MATCHES((DeviceRun<Q>(256, 128, 4, {{2, 0}}, 900)), Error,
                       Catch::Matchers::Predicate<Error>([](const Error& e) {
                         return e.code() == ErrorCode::kUnsupported &&
                                std::string(e.what()).find("shared memory") != std::string::npos;
                       }));
}

TEST_CASE("a full device pool rejects a stream and keeps its pages", "[cuda]") {
  using Q = quant::Q4_0;
  const auto data = make_stream_data(5 * 32, 64, 1, 1000);
  test::StreamFixture<Q> f(32, 64, 5, 0, data.keys, data.values);
  gpu::DevicePagePool pool({f.payload_bytes, 0}, 7);
  gpu::DeviceLayer<Q::key_codec, Q::value_codec> layer(pool, 1, 32, 64, f.value_offset);
  layer.add_stream(f.pages, {}, {}, {}, {});
  REQUIRE(pool.pages_in_use() == 5);
  test::StreamFixture<Q> g(32, 64, 5, 0, data.keys, data.values);  // other host pages: 5 more needed
  CHECK_THROWS_AS(layer.add_stream(g.pages, {}, {}, {}, {}), OutOfPages);
  CHECK(pool.pages_in_use() == 5);
  CHECK(layer.streams() == 1);
  layer.add_stream(f.pages, {}, {}, {}, {});  // the same host pages again: shared, no new page
  CHECK(pool.pages_in_use() == 5);
}

namespace {

/// Exact attention (double) over what a host cache stores for one layer (read_back: decoded pages
/// and fp32 rows), for scaled queries [streams][group][head_dim], and per stream the largest
/// |value| stored, which scales the fp32 bound.
struct ExactAttention {
  std::vector<double> out;
  std::vector<double> max_value;
};

template <class Cache>
ExactAttention exact_attention(const Cache& cache, SeqId seq, index_t layer, const std::vector<float>& scaled) {
  const index_t group = cache.shape().group_size();
  const index_t d = cache.shape().head_dim;
  ExactAttention exact;
  exact.out.resize(scaled.size());
  for (index_t s = 0; s < cache.streams_per_layer(); ++s) {
    const StoredTokens stored = cache.read_back(seq, layer, s);
    double max_value = 0.0;
    for (float v : stored.values) max_value = std::max(max_value, static_cast<double>(std::fabs(v)));
    exact.max_value.push_back(max_value);
    for (index_t h = 0; h < group; ++h) {
      const std::size_t first = (static_cast<std::size_t>(s) * group + h) * d;
      std::vector<double> scores(stored.size());
      double top = -std::numeric_limits<double>::infinity();
      for (index_t t = 0; t < stored.size(); ++t) {
        double dot = 0.0;
        for (index_t c = 0; c < d; ++c) {
          dot += static_cast<double>(scaled[first + c]) * stored.keys[static_cast<std::size_t>(t) * d + c];
        }
        scores[t] = dot;
        top = std::max(top, dot);
      }
      double sum = 0.0;
      std::vector<double> acc(d, 0.0);
      for (index_t t = 0; t < stored.size(); ++t) {
        const double w = std::exp(scores[t] - top);
        sum += w;
        for (index_t c = 0; c < d; ++c) acc[c] += w * stored.values[static_cast<std::size_t>(t) * d + c];
      }
      for (index_t c = 0; c < d; ++c) exact.out[first + c] = acc[c] / sum;
    }
  }
  return exact;
}

/// A device result against exact attention, within the fp32 bound.
void check_close(const float* got, const ExactAttention& exact) {
  const std::size_t per_stream = exact.out.size() / exact.max_value.size();
  for (std::size_t i = 0; i < exact.out.size(); ++i) {
    CHECK(std::fabs(got[i] - exact.out[i]) <= 1e-5 * exact.max_value[i / per_stream] + 1e-6);
  }
}

/// Runs `attend(query, scaled query, scale, out)` (device arrays) for one random query per head and
/// checks it against exact attention over what the host cache stores for the same layer.
template <class Cache, class Attend>
void check_against_read_back(const Cache& cache, SeqId seq, index_t layer, Attend attend, std::uint32_t seed) {
  const index_t d = cache.shape().head_dim;
  const auto query = test::random_rows(static_cast<std::size_t>(cache.shape().q_heads), d, seed);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> scaled(query);
  for (float& q : scaled) q *= scale;
  gpu::DeviceBuffer<float> device_query{std::span<const float>(query)};
  gpu::DeviceBuffer<float> device_scaled{std::span<const float>(scaled)};
  gpu::DeviceBuffer<float> out(scaled.size());
  attend(device_query.data(), device_scaled.data(), scale, out.data());
  gpu::check(cudaDeviceSynchronize(), "attention");
  check_close(out.download().data(), exact_attention(cache, seq, layer, scaled));
}

/// Options with a page size, an exact prefix and a tail window, the rest default.
CacheConfig window_config(index_t page_size, index_t exact_prefix, index_t tail_tokens) {
  CacheConfig config;
  config.page_size = page_size;
  config.exact_prefix_tokens = exact_prefix;
  config.tail_tokens = tail_tokens;
  return config;
}

/// A DeviceLayer's attend (queries already scaled) in check_against_read_back's form.
template <class Layer>
auto layer_attend(Layer& device) {
  return [&device](const float*, const float* scaled, float, float* out) { device.attend(scaled, out); };
}

/// Page bytes and row counts of a device layer against the host cache's layer.
template <class Cache, class Layer>
void check_same_pages(const Cache& cache, SeqId seq, index_t layer, const Layer& device) {
  const quant::PageGeometry g{cache.config().page_size, cache.shape().head_dim};
  const std::size_t key_bytes = cache.quantizer().key.plane_bytes(g);
  const std::size_t value_bytes = cache.quantizer().value.plane_bytes(g);
  const std::size_t v = cache.value_plane_offset();
  std::vector<std::byte> page(cache.page_format_info().payload_bytes);
  for (index_t s = 0; s < cache.streams_per_layer(); ++s) {
    INFO("layer " << layer << ", stream " << s);
    const std::span<const PageId> ids = cache.pages(seq, layer, s);
    REQUIRE(device.pages(s) == static_cast<index_t>(ids.size()));
    const index_t tokens = cache.read_back(seq, layer, s).size();
    CHECK(device.stored_rows(s).total() + device.pages(s) * g.page_size == tokens);
    CHECK(device.stored_rows(s).prefix == std::min(cache.config().exact_prefix_tokens, tokens));
    std::size_t mismatches = 0;
    for (std::size_t p = 0; p < ids.size(); ++p) {
      gpu::check(cudaMemcpy(page.data(), device.page(s, static_cast<index_t>(p)), page.size(), cudaMemcpyDeviceToHost),
                 "download");
      const std::byte* host = cache.pool().payload(ids[p]);
      mismatches += std::memcmp(page.data(), host, key_bytes) != 0;
      mismatches += std::memcmp(page.data() + v, host + v, value_bytes) != 0;
    }
    CHECK(mismatches == 0);
  }
}

}  // namespace

TEST_CASE("mirror_layer runs a host cache's layer on the device", "[cuda]") {
  using Cache = KVCache<layout::GQA, quant::Q4_0, evict::KeepAll>;
  const ModelShape shape{2, 8, 4, 64};
  CacheConfig config;
  config.page_size = 32;
  config.tail_tokens = 32;
  config.exact_prefix_tokens = 3;
  Cache cache(shape, config);
  const SeqId seq = cache.add_sequence();
  const auto keys = test::random_rows(300 * 4, 64, 1100, 4, 10.0f);
  const auto values = test::random_rows(300 * 4, 64, 1101);
  for (index_t layer = 0; layer < 2; ++layer) {
    cache.prefill(seq, layer, std::span<const float>(keys), std::span<const float>(values));
  }
  gpu::DevicePagePool pool(cache.page_format_info(), 256);
  auto device = gpu::mirror_layer(cache, seq, 1, pool);
  CHECK(device.streams() == 4);
  check_against_read_back(cache, seq, 1, layer_attend(device), 1102);

  config.key_rope = RopeSpec{};
  Cache rotated(shape, config);
  const SeqId other = rotated.add_sequence();
  rotated.prefill(other, 0, std::span<const float>(keys), std::span<const float>(values));
  CHECK_THROWS_AS(gpu::mirror_layer(rotated, other, 0, pool), Error);
}

namespace {

/// A quantizer for a cache of `shape`: KVQuant calibrated for every layer and KV head on rows
/// like the tests' (outlier key channels, other seeds), every other one as default-constructed.
template <class Quantizer>
Quantizer quantizer_for(const ModelShape& shape) {
  if constexpr (test::IsKVQuant<Quantizer>::value) {
    quant::KVQuantCalibrator calibrator(shape, {Quantizer::key_codec::kBits, 0.01, true, 50, 1});
    const auto rows = static_cast<std::size_t>(256) * shape.kv_heads;
    for (index_t layer = 0; layer < shape.layers; ++layer) {
      const auto seed = static_cast<std::uint32_t>(901 + 2 * layer);
      calibrator.add(layer, test::random_rows(rows, shape.head_dim, seed, 4, 10.0f),
                     test::random_rows(rows, shape.head_dim, seed + 1));
    }
    return Quantizer(calibrator.finish(), 0.01);
  } else {
    return Quantizer{};
  }
}

/// A mirrored layer that then takes its tokens on the device (append_tokens) next to the host
/// cache taking the same ones: after every append the device's pages hold the host's bytes and
/// its row counts the host's, and attention over it matches exact attention over read_back.
template <class Quantizer>
void check_device_appends(index_t page_size, index_t exact_prefix, index_t tail_tokens, index_t head_dim,
                          std::uint32_t seed) {
  const ModelShape shape{1, 6, 3, head_dim};
  CacheConfig config = window_config(page_size, exact_prefix, tail_tokens);
  KVCache<layout::GQA, Quantizer> cache(shape, config, quantizer_for<Quantizer>(shape));
  const SeqId seq = cache.add_sequence();
  auto host_append = [&](index_t count, std::int64_t at, const std::vector<float>& keys,
                         const std::vector<float>& values) {
    if (count == 1) {
      cache.append(seq, 0, std::span<const float>(keys), std::span<const float>(values), at);
    } else {
      cache.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values));
    }
  };
  index_t written = 2 * page_size + 5;
  const auto rows = static_cast<std::size_t>(written) * 3;
  host_append(written, 0, test::random_rows(rows, head_dim, seed, 4, 10.0f),
              test::random_rows(rows, head_dim, seed + 1));
  gpu::DevicePagePool pool(cache.page_format_info(), 64);
  auto device = gpu::mirror_layer(cache, seq, 0, pool);

  const index_t sizes[] = {1, 1, page_size - 1, 1, 2 * page_size + 3, 1, page_size, 7, 1};
  std::uint32_t call_seed = seed + 10;
  for (index_t count : sizes) {
    const auto keys = test::random_rows(static_cast<std::size_t>(count) * 3, head_dim, call_seed++, 4, 10.0f);
    const auto values = test::random_rows(static_cast<std::size_t>(count) * 3, head_dim, call_seed++);
    host_append(count, written, keys, values);
    written += count;
    INFO(Quantizer::name() << " page " << page_size << " prefix " << exact_prefix << " tail " << tail_tokens << ": "
                           << written << " tokens");
    const gpu::DeviceBuffer<float> device_keys{std::span<const float>(keys)};
    const gpu::DeviceBuffer<float> device_values{std::span<const float>(values)};
    device.append_tokens(device_keys.data(), device_values.data(), count);
    gpu::check(cudaDeviceSynchronize(), "append_tokens");
    check_same_pages(cache, seq, 0, device);
    check_against_read_back(cache, seq, 0, layer_attend(device), call_seed++);
  }
}

}  // namespace

TEST_CASE("tokens appended on the device follow the host cache's pages and rows", "[cuda][append]") {
  check_device_appends<quant::Q4_0>(32, 0, 0, 128, 1500);
  check_device_appends<quant::Q4_0>(32, 3, 32, 64, 1510);
  check_device_appends<quant::Float<kvpack::half>>(16, 5, 0, 64, 1520);
  check_device_appends<quant::Int8>(32, 0, 64, 96, 1530);
  check_device_appends<quant::KIVI<4, 32>>(32, 0, 32, 128, 1540);
  check_device_appends<quant::KIVI<2, 32>>(64, 2, 0, 64, 1550);
  check_device_appends<quant::KVQuant<4>>(32, 1, 32, 128, 1560);  // KVQuant's staged encoders
  check_device_appends<quant::KVQuant<3>>(16, 0, 0, 64, 1570);
  check_device_appends<quant::KVQuant<2>>(64, 1, 0, 96, 1580);
}

namespace {

/// Pages encoded on the device (append_pages) against the host's scalar encoder, byte for byte:
/// rows like the calibration's, rows far outside it (for KVQuant every key a candidate, more
/// than the section holds), and equal elements (ties in how far outside).
template <class Quantizer>
void check_device_pages(const Quantizer& q, quant::PageGeometry g, std::uint32_t seed) {
  const auto key_params = q.key.initial_params(0, 0);
  const auto value_params = q.value.initial_params(0, 0);
  if constexpr (requires { q.key.prepare(g, key_params); }) {  // TurboQuant's tables, as KVCache builds them
    q.key.prepare(g, key_params);
    q.value.prepare(g, value_params);
  }
  const std::size_t value_offset = (q.key.plane_bytes(g) + 63) / 64 * 64;
  const std::size_t payload = (value_offset + q.value.plane_bytes(g) + 63) / 64 * 64;
  const auto page_rows = static_cast<std::size_t>(g.page_size);
  std::vector<float> keys = test::random_rows(page_rows, g.head_dim, seed, 4, 10.0f);
  std::vector<float> values = test::random_rows(page_rows, g.head_dim, seed + 1);
  const auto far = test::random_rows(page_rows, g.head_dim, seed + 2, g.head_dim, 300.0f);
  keys.insert(keys.end(), far.begin(), far.end());
  values.insert(values.end(), far.begin(), far.end());
  for (std::size_t i = 0; i < page_rows * g.head_dim; ++i) {
    keys.push_back(i % 5 == 0 ? -7.0f : 7.0f);
    values.push_back(i % 5 == 0 ? -7.0f : 7.0f);
  }
  gpu::DevicePagePool pool({payload, 0}, 3);
  gpu::DeviceLayer<typename Quantizer::key_codec, typename Quantizer::value_codec> layer(pool, 1, g.page_size,
                                                                                         g.head_dim, value_offset);
  layer.add_stream({}, key_params, value_params, {}, {});
  const gpu::DeviceBuffer<float> device_keys{std::span<const float>(keys)};
  const gpu::DeviceBuffer<float> device_values{std::span<const float>(values)};
  layer.append_pages(0, device_keys.data(), device_values.data(), 3);
  gpu::check(cudaDeviceSynchronize(), "append_pages");
  std::vector<std::byte> got(payload), want(payload);
  for (index_t i = 0; i < 3; ++i) {
    INFO(Quantizer::name() << " page_size " << g.page_size << " head_dim " << g.head_dim << " page " << i);
    const std::size_t first = static_cast<std::size_t>(i) * page_rows * g.head_dim;
    q.key.encode(g, keys.data() + first, g.head_dim, key_params, want.data());
    q.value.encode(g, values.data() + first, g.head_dim, value_params, want.data() + value_offset);
    gpu::check(cudaMemcpy(got.data(), layer.page(0, i), payload, cudaMemcpyDeviceToHost), "download");
    CHECK(std::memcmp(got.data(), want.data(), q.key.plane_bytes(g)) == 0);
    CHECK(std::memcmp(got.data() + value_offset, want.data() + value_offset, q.value.plane_bytes(g)) == 0);
  }
}

/// check_device_pages for KVQuant<Bits> at an outlier fraction, calibrated as the other tests
/// are, or with Q-Norm (rounded to other levels than decoded).
template <int Bits>
void check_kvquant_pages(quant::PageGeometry g, double fraction, std::uint32_t seed, bool q_norm = false) {
  INFO("outlier fraction " << fraction << (q_norm ? ", Q-Norm" : ""));
  check_device_pages(quant::KVQuant<Bits>(test::kvquant_tables<Bits>(g.head_dim, q_norm, seed), fraction), g, seed);
}

}  // namespace

TEST_CASE("KVQuant pages encoded on the device hold the host encoder's bytes", "[cuda][append]") {
  for (const double fraction : {0.0, 0.01, 0.05}) {
    check_kvquant_pages<4>({32, 128}, fraction, 1590);
    check_kvquant_pages<3>({16, 64}, fraction, 1591);
    check_kvquant_pages<2>({64, 96}, fraction, 1592);
  }
  check_kvquant_pages<3>({256, 256}, 0.01, 1593);  // a cache's largest page: 22 KiB of block memory
  check_kvquant_pages<2>({32, 128}, 0.01, 1594, true);
  check_kvquant_pages<4>({16, 64}, 0.03125, 1595);  // every value candidate kept, none capped
}

TEST_CASE("TurboQuant-MSE pages encoded on the device hold the host encoder's bytes", "[cuda][append]") {
  // Hadamard rotations at head_dim 128 and 64, the dense one at 96; 4, 3.5, 3 and 2.5 bits.
  check_device_pages(quant::TurboQuant<8>{}, {32, 128}, 1596);
  check_device_pages(quant::TurboQuant<7>{}, {16, 64}, 1597);
  check_device_pages(quant::TurboQuant<6>{}, {32, 96}, 1598);
  check_device_pages(quant::TurboQuant<5>{}, {64, 128}, 1599);
}

namespace {

/// Writes the same rows ([tokens][kv_heads][head_dim]) to a host and a device sequence: a
/// prefill when `position` < 0, else an append at `position`.
template <class HostCache, class DeviceCache>
void write_rows_both(HostCache& host, SeqId host_seq, DeviceCache& device, SeqId device_seq, index_t layer,
                     std::span<const float> keys, std::span<const float> values, std::int64_t position) {
  const gpu::DeviceBuffer<float> device_keys{keys};
  const gpu::DeviceBuffer<float> device_values{values};
  const std::span<const float> dk(device_keys.data(), keys.size()), dv(device_values.data(), values.size());
  if (position < 0) {
    host.prefill(host_seq, layer, keys, values);
    device.prefill(device_seq, layer, dk, dv);
  } else {
    host.append(host_seq, layer, keys, values, position);
    device.append(device_seq, layer, dk, dv, position);
  }
  gpu::check(cudaDeviceSynchronize(), "write");
}

/// write_rows_both with `tokens` random tokens (keys with outlier channels).
template <class HostCache, class DeviceCache>
void write_both(HostCache& host, SeqId host_seq, DeviceCache& device, SeqId device_seq, index_t layer,
                index_t tokens, std::int64_t position, std::uint32_t& seed) {
  const ModelShape& shape = host.shape();
  const std::size_t rows = static_cast<std::size_t>(tokens) * shape.kv_heads;
  const auto keys = test::random_rows(rows, shape.head_dim, seed++, 4, 10.0f);
  const auto values = test::random_rows(rows, shape.head_dim, seed++);
  write_rows_both(host, host_seq, device, device_seq, layer, std::span<const float>(keys),
                  std::span<const float>(values), position);
}

/// A device sequence against its host twin in one layer: the same page bytes, row counts, length,
/// last position and codec parameters, read_back equal to the host's (positions, decoded pages,
/// fp32 rows), and DeviceKVCache::attend (scale applied on the device) within the exact bound.
template <class HostCache, class DeviceCache>
void check_twins(const HostCache& host, SeqId host_seq, DeviceCache& device, SeqId device_seq, index_t layer,
                 std::uint32_t seed) {
  check_same_pages(host, host_seq, layer, device.layer(device_seq, layer));
  CHECK(device.length(device_seq, layer) == host.length(host_seq, layer));
  CHECK(device.last_position(device_seq, layer) == host.last_position(host_seq, layer));
  for (index_t s = 0; s < host.streams_per_layer(); ++s) {
    const StoredTokens want = host.read_back(host_seq, layer, s);
    const StoredTokens got = device.read_back(device_seq, layer, s);
    if constexpr (DeviceCache::kSameParams) {
      CHECK(device.layer(device_seq, layer).key_params(s) == host.codec_params(layer, s).first);
      CHECK(device.layer(device_seq, layer).value_params(s) == host.codec_params(layer, s).second);
    } else {  // KVQuant: the same calibration tables on both sides
      CHECK(device.codec_params(layer, s) == host.codec_params(layer, s));
    }
    CHECK(got.positions == want.positions);
    CHECK(got.keys == want.keys);  // the same bytes through the same scalar decode
    CHECK(got.values == want.values);
  }
  check_against_read_back(
      host, host_seq, layer,
      [&](const float* query, const float*, float scale, float* out) {
        const std::size_t n = static_cast<std::size_t>(host.shape().q_heads) * host.shape().head_dim;
        device.attend(device_seq, layer, std::span<const float>(query, n), std::span<float>(out, n), scale);
      },
      seed);
}

/// What a device cache holds against its host twin's: pages, their bytes and the elements stored
/// (forks counting shared tokens again on both), and some device memory for rows and tables.
template <class HostCache, class DeviceCache>
void check_same_memory(const HostCache& host, const DeviceCache& device) {
  const MemoryUsage on_host = host.memory(), on_device = device.memory();
  CHECK(on_device.pages_in_use == on_host.pages_in_use);
  CHECK(on_device.page_payload == on_host.page_payload);
  CHECK(on_device.stored_elements == on_host.stored_elements);
  CHECK(on_device.tails > 0);
  CHECK(on_device.tables > 0);
  CHECK(device.sequence_count() == host.sequence_count());
}

/// A cache created on the device and a host KVCache fed the same tokens (chunked prefill, appends
/// with a gap in positions): the same pages, rows and attention in every layer.
template <class Quantizer>
void check_device_cache(index_t page_size, index_t exact_prefix, index_t tail_tokens, index_t head_dim,
                        std::uint32_t seed, Quantizer quantizer = {}) {
  const ModelShape shape{2, 8, 4, head_dim};
  CacheConfig config = window_config(page_size, exact_prefix, tail_tokens);
  KVCache<layout::GQA, Quantizer> host(shape, config, quantizer);
  gpu::DeviceKVCache<Quantizer> device(shape, config, 128, quantizer);
  const SeqId host_seq = host.add_sequence();
  const SeqId device_seq = device.add_sequence();
  std::uint32_t data_seed = seed;
  for (index_t layer = 0; layer < 2; ++layer) {
    write_both(host, host_seq, device, device_seq, layer, 2 * page_size + 3, -1, data_seed);
    write_both(host, host_seq, device, device_seq, layer, page_size + 1, -1, data_seed);
    const std::int64_t next = 3 * page_size + 4;
    for (std::int64_t t = 0; t < page_size + 2; ++t) {
      write_both(host, host_seq, device, device_seq, layer, 1, next + t + (t > 3 ? 5 : 0), data_seed);
    }
    INFO(Quantizer::name() << " layer " << layer);
    check_twins(host, host_seq, device, device_seq, layer, data_seed++);
  }
  check_same_memory(host, device);
  CHECK(device.pool().pages_in_use() > 0);
  device.release(device_seq);
  CHECK(device.pool().pages_in_use() == 0);
}

/// A sequence prefilled on the host, adopted by a device cache, then decoded on both: the same
/// pages, rows and attention as the host cache after every few tokens.
template <class Quantizer>
void check_adopt(index_t page_size, index_t exact_prefix, index_t tail_tokens, std::uint32_t seed) {
  const ModelShape shape{2, 4, 2, 64};
  CacheConfig config = window_config(page_size, exact_prefix, tail_tokens);
  const Quantizer quantizer = quantizer_for<Quantizer>(shape);
  KVCache<layout::GQA, Quantizer> host(shape, config, quantizer);
  const SeqId host_seq = host.add_sequence();
  const index_t prompt = 3 * page_size + 9;
  for (index_t layer = 0; layer < 2; ++layer) {
    const auto keys = test::random_rows(static_cast<std::size_t>(prompt) * 2, 64, seed + layer, 4, 10.0f);
    const auto values = test::random_rows(static_cast<std::size_t>(prompt) * 2, 64, seed + 10 + layer);
    host.prefill(host_seq, layer, std::span<const float>(keys), std::span<const float>(values));
  }
  gpu::DeviceKVCache<Quantizer> device(shape, config, 64, quantizer);
  const SeqId device_seq = device.adopt(host, host_seq);
  std::uint32_t data_seed = seed + 100;
  for (index_t t = 0; t < page_size + 3; ++t) {
    for (index_t layer = 0; layer < 2; ++layer) {
      write_both(host, host_seq, device, device_seq, layer, 1, prompt + t, data_seed);
    }
  }
  for (index_t layer = 0; layer < 2; ++layer) {
    INFO(Quantizer::name() << " adopted, layer " << layer);
    check_twins(host, host_seq, device, device_seq, layer, data_seed++);
  }
  CacheConfig other = config;
  other.page_size = 2 * page_size;
  KVCache<layout::GQA, Quantizer> mismatched(shape, other, quantizer);
  const SeqId mismatched_seq = mismatched.add_sequence();
  CHECK_THROWS_AS(device.adopt(mismatched, mismatched_seq), Error);
  if constexpr (test::IsKVQuant<Quantizer>::value) {  // pages encoded with another calibration
    KVCache<layout::GQA, Quantizer> recalibrated(shape, config, quantizer_for<Quantizer>(shape));
    const SeqId recalibrated_seq = recalibrated.add_sequence();
    expect_error([&] { (void)device.adopt(recalibrated, recalibrated_seq); }, ErrorCode::kInvalidArgument,
                 "calibration");
  }
}

/// A host and a device sequence forked at the same point (mid-page, rows in the tail), then
/// parent and fork fed different tokens on both sides: all four hold their twins' pages and
/// attend like them. The fork takes no page of its own until it fills one, and the pages it
/// shares outlive the parent.
template <class Quantizer>
void check_fork(index_t page_size, index_t exact_prefix, index_t tail_tokens, std::uint32_t seed) {
  const ModelShape shape{2, 4, 2, 64};
  CacheConfig config = window_config(page_size, exact_prefix, tail_tokens);
  const Quantizer quantizer = quantizer_for<Quantizer>(shape);
  KVCache<layout::GQA, Quantizer> host(shape, config, quantizer);
  gpu::DeviceKVCache<Quantizer> device(shape, config, 128, quantizer);
  const SeqId host_parent = host.add_sequence();
  const SeqId device_parent = device.add_sequence();
  std::uint32_t data_seed = seed;
  const index_t prompt = 2 * page_size + 5;
  for (index_t layer = 0; layer < 2; ++layer) {
    write_both(host, host_parent, device, device_parent, layer, prompt, -1, data_seed);
  }
  const std::size_t shared = device.pool().pages_in_use();
  const SeqId host_child = host.fork(host_parent);
  const SeqId device_child = device.fork(device_parent);
  CHECK(device.pool().pages_in_use() == shared);
  for (index_t t = 0; t < page_size + 3; ++t) {
    for (index_t layer = 0; layer < 2; ++layer) {
      write_both(host, host_parent, device, device_parent, layer, 1, prompt + t, data_seed);
      write_both(host, host_child, device, device_child, layer, 1, prompt + t, data_seed);
    }
  }
  auto pages_of = [&](SeqId seq) {
    std::size_t pages = 0;
    for (index_t layer = 0; layer < 2; ++layer) pages += device.layer(seq, layer).device_pages();
    return pages;
  };
  CHECK(pages_of(device_parent) > shared);  // each filled pages of its own
  CHECK(device.pool().pages_in_use() == pages_of(device_parent) + pages_of(device_child) - shared);
  check_same_memory(host, device);
  for (index_t layer = 0; layer < 2; ++layer) {
    INFO(Quantizer::name() << " forked, layer " << layer);
    check_twins(host, host_parent, device, device_parent, layer, data_seed++);
    check_twins(host, host_child, device, device_child, layer, data_seed++);
  }
  device.release(device_parent);
  CHECK(device.pool().pages_in_use() == pages_of(device_child));
  for (index_t layer = 0; layer < 2; ++layer) {
    INFO(Quantizer::name() << " fork after its parent's release, layer " << layer);
    check_twins(host, host_child, device, device_child, layer, data_seed++);
  }
  device.release(device_child);
  CHECK(device.pool().pages_in_use() == 0);
}

}  // namespace

TEST_CASE("a forked device sequence shares its parent's pages and diverges from it", "[cuda][device_cache]") {
  check_fork<quant::Q4_0>(32, 0, 0, 1900);
  check_fork<quant::Float<kvpack::half>>(16, 3, 16, 1910);
  check_fork<quant::KIVI<4, 32>>(32, 2, 32, 1920);
  check_fork<quant::KVQuant<3>>(32, 1, 32, 1930);  // the fork shares its parent's key-range tables
}

TEST_CASE("a sequence prefilled on the host continues on the device", "[cuda][device_cache]") {
  check_adopt<quant::Q4_0>(32, 0, 0, 1800);
  check_adopt<quant::Float<kvpack::half>>(16, 3, 16, 1810);
  check_adopt<quant::KIVI<2, 32>>(32, 0, 32, 1820);
  check_adopt<quant::KVQuant<4>>(32, 1, 0, 1830);
}

TEST_CASE("a cache created on the device holds the host cache's pages and attends like it", "[cuda][device_cache]") {
  check_device_cache<quant::Q4_0>(32, 0, 0, 128, 1600);
  check_device_cache<quant::Float<kvpack::half>>(16, 3, 32, 64, 1610);
  check_device_cache<quant::KIVI<4, 32>>(32, 0, 32, 128, 1620);
  check_device_cache<quant::Int8>(32, 2, 0, 96, 1630);
  check_device_cache<quant::KVQuant<4>>(32, 1, 32, 128, 1640,
                                        quantizer_for<quant::KVQuant<4>>(ModelShape{2, 8, 4, 128}));
  check_device_cache<quant::KVQuant<2>>(16, 0, 0, 64, 1650,
                                        quantizer_for<quant::KVQuant<2>>(ModelShape{2, 8, 4, 64}));
}

namespace {

/// A codec that calibrates from the data (FP8's default), in two sequences on both sides: the
/// first fills a page of each layer first, one token at a time after a short prefill, so the
/// layer's scales come from its tail rows and that token (after the exact prefix); the second,
/// with rows in its tail by then, encodes its first page with those scales later. Every page
/// equal to the host's means the device calibrated as the host does.
template <class Quantizer>
void check_calibration(Quantizer quantizer, index_t page_size, index_t exact_prefix, index_t tail_tokens,
                       std::uint32_t seed) {
  const ModelShape shape{2, 4, 2, 64};
  CacheConfig config = window_config(page_size, exact_prefix, tail_tokens);
  KVCache<layout::GQA, Quantizer> host(shape, config, quantizer);
  gpu::DeviceKVCache<Quantizer> device(shape, config, 64, quantizer);
  const SeqId host_a = host.add_sequence(), host_b = host.add_sequence();
  const SeqId device_a = device.add_sequence(), device_b = device.add_sequence();
  std::uint32_t data_seed = seed;
  const index_t start_a = page_size / 2, start_b = 3;
  for (index_t layer = 0; layer < 2; ++layer) {
    write_both(host, host_a, device, device_a, layer, start_a, -1, data_seed);
    write_both(host, host_b, device, device_b, layer, start_b, -1, data_seed);
  }
  for (index_t t = 0; t < exact_prefix + tail_tokens + 2 * page_size; ++t) {
    for (index_t layer = 0; layer < 2; ++layer) {
      write_both(host, host_a, device, device_a, layer, 1, start_a + t, data_seed);
      write_both(host, host_b, device, device_b, layer, 1, start_b + t, data_seed);
    }
  }
  for (index_t layer = 0; layer < 2; ++layer) {
    INFO(Quantizer::name() << " calibrated from the data, layer " << layer);
    CHECK(device.layer(device_b, layer).pages(0) > 0);
    check_twins(host, host_a, device, device_a, layer, data_seed++);
    check_twins(host, host_b, device, device_b, layer, data_seed++);
  }
}

/// Calibration rows made visible: an exact-prefix row at 1000 that must not set the scale, and
/// the largest value elsewhere in a tail row, which must. Once in a prefill that fills the exact
/// prefix and a page in one call (the rows after the pinned ones), once in a second prefill after
/// the first left rows in the tail (the tail rows after the prefix, and the new rows).
void check_calibration_rows(quant::ScaleGranularity granularity, std::uint32_t seed) {
  using E4M3 = quant::FP8<quant::E4M3FN>;
  const E4M3 quantizer(quant::FP8Options{granularity});
  const ModelShape shape{1, 4, 2, 64};
  const CacheConfig config = window_config(16, 3, 16);
  for (const bool tail_first : {false, true}) {
    KVCache<layout::GQA, E4M3> host(shape, config, quantizer);
    gpu::DeviceKVCache<E4M3> device(shape, config, 16, quantizer);
    const SeqId host_seq = host.add_sequence();
    const SeqId device_seq = device.add_sequence();
    const index_t tokens = 40;
    auto keys = test::random_rows(static_cast<std::size_t>(tokens) * 2, 64, seed);
    auto values = test::random_rows(static_cast<std::size_t>(tokens) * 2, 64, seed + 1);
    keys[(1 * 2 + 0) * 64 + 5] = 1000.0f;  // exact prefix: token 1, stream 0
    values[(2 * 2 + 1) * 64 + 7] = -1000.0f;
    keys[(9 * 2 + 1) * 64 + 3] = 60.0f;  // in the tail either way: token 9, stream 1
    values[(8 * 2 + 0) * 64 + 4] = 30.0f;
    const index_t first = tail_first ? 13 : tokens;  // 3 exact + 10 tail rows, no page yet
    const std::size_t row = 2 * 64;
    for (const auto [from, count] : {std::pair{index_t{0}, first}, std::pair{first, tokens - first}}) {
      if (count == 0) continue;
      const std::span<const float> k(keys.data() + from * row, count * row), v(values.data() + from * row, count * row);
      const gpu::DeviceBuffer<float> device_keys{k}, device_values{v};
      host.prefill(host_seq, 0, k, v);
      device.prefill(device_seq, 0, {device_keys.data(), k.size()}, {device_values.data(), v.size()});
      gpu::check(cudaDeviceSynchronize(), "prefill");
    }
    INFO("per head " << (granularity == quant::ScaleGranularity::kPerHead) << ", tail first " << tail_first);
    REQUIRE(host.pages(host_seq, 0, 1).size() == 1);
    CHECK(host.codec_params(0, 1).first.scale == 60.0f / 200.0f);  // the data do what the case needs
    CHECK(host.codec_params(0, 0).second.scale == 30.0f / 100.0f);
    check_twins(host, host_seq, device, device_seq, 0, seed + 2);
  }
}

}  // namespace

TEST_CASE("a device cache calibrates FP8 scales from the data as the host cache does", "[cuda][device_cache]") {
  using E4M3 = quant::FP8<quant::E4M3FN>;
  check_calibration(E4M3{}, 32, 0, 0, 2000);
  check_calibration(E4M3(quant::FP8Options{quant::ScaleGranularity::kPerHead}), 16, 3, 16, 2010);
  check_calibration(quant::FP8<quant::E5M2>{}, 32, 2, 32, 2020);
  check_device_cache<E4M3>(32, 0, 0, 128, 2030);  // calibrated by a prefill that fills pages at once
  check_adopt<E4M3>(32, 0, 0, 2040);              // the host's scales come with the sequence
  check_calibration_rows(quant::ScaleGranularity::kPerTensor, 2070);
  check_calibration_rows(quant::ScaleGranularity::kPerHead, 2080);

  // A second host cache calibrated on other data: its pages cannot join the device cache's layers.
  const ModelShape shape{1, 4, 2, 64};
  const CacheConfig config = window_config(32, 0, 0);
  gpu::DeviceKVCache<E4M3> device(shape, config, 16);
  for (std::uint32_t data : {2050u, 2060u}) {
    KVCache<layout::GQA, E4M3> host(shape, config);
    const SeqId seq = host.add_sequence();
    const auto keys = test::random_rows(40 * 2, 64, data, 4, data == 2050u ? 10.0f : 30.0f);
    const auto values = test::random_rows(40 * 2, 64, data + 1);
    host.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values));
    if (data == 2050u) {
      static_cast<void>(device.adopt(host, seq));
    } else {
      expect_error([&] { static_cast<void>(device.adopt(host, seq)); }, ErrorCode::kInvalidArgument,
                   "calibrated with other parameters");
    }
  }
}

namespace {

/// A decode on a non-blocking stream that nothing synchronises until the end: after a prefill,
/// rounds of append and attend (each into its own output) cross four pages, so block tables are
/// rewritten in place, and grow, while earlier launches may still read them. Each output must
/// match exact attention over the host twin as it stood at that step.
template <class Quantizer>
void check_unsynchronized_stream(index_t page_size, std::uint32_t seed) {
  const ModelShape shape{1, 4, 2, 64};
  const CacheConfig config = window_config(page_size, 0, 0);
  KVCache<layout::GQA, Quantizer> host(shape, config);
  gpu::DeviceKVCache<Quantizer> device(shape, config, 64);
  const SeqId host_seq = host.add_sequence();
  const SeqId device_seq = device.add_sequence();
  const index_t prompt = page_size + 3, steps = 4 * page_size + 5;
  const std::size_t row = 2 * 64, heads = 4 * 64;
  const auto keys = test::random_rows(static_cast<std::size_t>(prompt + steps) * 2, 64, seed, 4, 10.0f);
  const auto values = test::random_rows(static_cast<std::size_t>(prompt + steps) * 2, 64, seed + 1);
  const auto queries = test::random_rows(static_cast<std::size_t>(steps) * 4, 64, seed + 2);
  const gpu::DeviceBuffer<float> device_keys{std::span<const float>(keys)};
  const gpu::DeviceBuffer<float> device_values{std::span<const float>(values)};
  const gpu::DeviceBuffer<float> device_queries{std::span<const float>(queries)};
  gpu::DeviceBuffer<float> outs(queries.size());
  cudaStream_t stream = nullptr;
  gpu::check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  const std::span<const float> all_keys(keys), all_values(values);
  host.prefill(host_seq, 0, all_keys.first(prompt * row), all_values.first(prompt * row));
  device.prefill(device_seq, 0, {device_keys.data(), prompt * row}, {device_values.data(), prompt * row}, stream);
  const float scale = 0.125f;
  std::vector<ExactAttention> expected;
  for (index_t t = 0; t < steps; ++t) {
    const std::size_t at = static_cast<std::size_t>(prompt + t) * row;
    host.append(host_seq, 0, all_keys.subspan(at, row), all_values.subspan(at, row), prompt + t);
    device.append(device_seq, 0, {device_keys.data() + at, row}, {device_values.data() + at, row}, prompt + t,
                  stream);
    const std::size_t q = static_cast<std::size_t>(t) * heads;
    device.attend(device_seq, 0, {device_queries.data() + q, heads}, {outs.data() + q, heads}, scale, stream);
    std::vector<float> scaled(queries.begin() + static_cast<std::ptrdiff_t>(q),
                              queries.begin() + static_cast<std::ptrdiff_t>(q + heads));
    for (float& x : scaled) x *= scale;
    expected.push_back(exact_attention(host, host_seq, 0, scaled));
  }
  gpu::check(cudaStreamSynchronize(stream), "decode");
  gpu::check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  const std::vector<float> got = outs.download();
  for (index_t t = 0; t < steps; ++t) {
    INFO(Quantizer::name() << " step " << t);
    check_close(got.data() + static_cast<std::size_t>(t) * heads, expected[t]);
  }
}

}  // namespace

TEST_CASE("a decode on a non-blocking stream needs no synchronisation between steps", "[cuda][device_cache]") {
  check_unsynchronized_stream<quant::Q4_0>(32, 2100);              // tensor cores
  check_unsynchronized_stream<quant::Float<kvpack::half>>(16, 2110);  // generic kernel
}

namespace {

/// One prompt's K/V in every layer ([tokens][kv_heads][head_dim] keys and values per layer): the
/// same tokens must be written with the same K/V for a cached prefix to stand for them.
struct PromptRows {
  std::vector<std::vector<float>> keys, values;  // per layer

  PromptRows(const ModelShape& shape, index_t tokens, std::uint32_t seed) {
    const std::size_t rows = static_cast<std::size_t>(tokens) * shape.kv_heads;
    for (index_t layer = 0; layer < shape.layers; ++layer) {
      keys.push_back(test::random_rows(rows, shape.head_dim, seed++, 4, 10.0f));
      values.push_back(test::random_rows(rows, shape.head_dim, seed++));
    }
  }
  /// Tokens [first, end) of one layer, as floats of keys or values.
  static std::span<const float> rows(const std::vector<float>& all, const ModelShape& shape, index_t first) {
    const std::size_t offset = static_cast<std::size_t>(first) * shape.kv_heads * shape.head_dim;
    return std::span<const float>(all).subspan(offset);
  }
};

/// A request on both sides: starts on the cache's cached prefix of `prompt`, prefills the rest of
/// it and decodes `decode` random tokens. Returns the two sequences.
template <class HostCache, class DeviceCache>
std::pair<SeqId, SeqId> serve_both(HostCache& host, DeviceCache& device, const std::vector<paging::TokenId>& prompt,
                                   const PromptRows& rows, std::string_view salt, index_t decode,
                                   std::uint32_t& seed, index_t* cached = nullptr) {
  const PrefixHit on_host = host.add_sequence(prompt, salt);
  const PrefixHit on_device = device.add_sequence(prompt, salt);
  REQUIRE(on_device.cached_tokens == on_host.cached_tokens);  // the rows below start there on both
  if (cached != nullptr) *cached = on_device.cached_tokens;
  const ModelShape& shape = host.shape();
  const auto length = static_cast<index_t>(prompt.size());
  for (index_t layer = 0; layer < shape.layers; ++layer) {
    CHECK(device.length(on_device.seq, layer) == on_device.cached_tokens);
    write_rows_both(host, on_host.seq, device, on_device.seq, layer,
                    PromptRows::rows(rows.keys[layer], shape, on_host.cached_tokens),
                    PromptRows::rows(rows.values[layer], shape, on_host.cached_tokens), -1);
    for (index_t t = 0; t < decode; ++t) {
      write_both(host, on_host.seq, device, on_device.seq, layer, 1, length + t, seed);
    }
  }
  return {on_host.seq, on_device.seq};
}

/// Prefix sharing on both sides with the same requests: a first prefills a prompt, decodes and
/// caches the prompt's whole pages (share_prefix, then release); a second with the same prompt
/// starts on them (as many tokens on both sides), prefills only the rest and decodes otherwise;
/// both then hold their twins' pages and attend like them, with the same pages in use (the
/// index's included). A fork shares the second's pin on the cached pages. A third under another
/// salt finds nothing. Releasing everything leaves the cached pages, which evict_prefix_cache
/// gives back.
template <class Quantizer>
void check_prefix_sharing(index_t page_size, index_t tail_tokens, std::uint32_t seed) {
  const ModelShape shape{2, 4, 2, 64};
  CacheConfig config = window_config(page_size, 0, tail_tokens);
  config.prefix_sharing = PrefixSharing{"prefix-test"};
  KVCache<layout::GQA, Quantizer> host(shape, config);
  gpu::DeviceKVCache<Quantizer> device(shape, config, 96);
  const index_t length = 3 * page_size + tail_tokens + 5;
  std::vector<paging::TokenId> prompt(static_cast<std::size_t>(length));
  for (index_t i = 0; i < length; ++i) prompt[i] = 1000 + 7 * i;
  const PromptRows rows(shape, length, seed);
  std::uint32_t data_seed = seed + 100;
  const auto holders_of_first_pages = [&](SeqId seq) {
    std::vector<std::uint32_t> holders;
    for (index_t layer = 0; layer < 2; ++layer) {
      for (index_t s = 0; s < 2; ++s) {
        holders.push_back(device.pool().ref_count(device.layer(seq, layer).page_id(s, 0)));
      }
    }
    return holders;
  };

  const auto [host_first, device_first] = serve_both(host, device, prompt, rows, "", 4, data_seed);
  CHECK(holders_of_first_pages(device_first) == std::vector<std::uint32_t>(4, 1));
  CHECK(host.share_prefix(host_first) == 3 * page_size);
  CHECK(device.share_prefix(device_first) == 3 * page_size);
  CHECK(holders_of_first_pages(device_first) == std::vector<std::uint32_t>(4, 2));  // the sequence, the index
  host.release(host_first);
  device.release(device_first);
  CHECK(device.prefix_stats().cached_pages == 3);
  CHECK(host.prefix_stats().cached_pages == 3);

  index_t cached = 0;
  const auto [host_second, device_second] = serve_both(host, device, prompt, rows, "", page_size + 2, data_seed,
                                                       &cached);
  CHECK(cached == 3 * page_size);
  check_same_memory(host, device);
  CHECK(holders_of_first_pages(device_second) == std::vector<std::uint32_t>(4, 2));  // shared, not copied
  for (index_t layer = 0; layer < 2; ++layer) {
    INFO(Quantizer::name() << " started on a cached prefix, layer " << layer);
    for (index_t s = 0; s < 2; ++s) CHECK(device.layer(device_second, layer).pages(s) >= 3);
    check_twins(host, host_second, device, device_second, layer, data_seed++);
  }
  const SeqId device_fork = device.fork(device_second);
  CHECK(holders_of_first_pages(device_fork) == std::vector<std::uint32_t>(4, 3));
  device.release(device_second);
  CHECK(device.evict_prefix_cache().token_pages == 0);  // the fork's lease still pins the prefix
  CHECK(device.prefix_stats().cached_pages == 3);

  const auto [host_other, device_other] = serve_both(host, device, prompt, rows, "tenant-b", 0, data_seed, &cached);
  CHECK(cached == 0);
  for (index_t layer = 0; layer < 2; ++layer) check_twins(host, host_other, device, device_other, layer, data_seed++);

  host.release(host_second);
  host.release(host_other);
  device.release(device_other);
  device.release(device_fork);
  const paging::PrefixIndexStats stats = device.prefix_stats();
  CHECK(stats.cached_pool_pages == device.pool().pages_in_use());
  CHECK(device.evict_prefix_cache().pool_pages_freed == stats.cached_pool_pages);
  CHECK(device.pool().pages_in_use() == 0);
}

}  // namespace

TEST_CASE("a device cache shares prompt prefixes as the host cache does", "[cuda][device_cache][prefix]") {
  check_prefix_sharing<quant::Q4_0>(32, 0, 2100);
  check_prefix_sharing<quant::Float<kvpack::half>>(16, 16, 2110);
  check_prefix_sharing<quant::FP8<quant::E4M3FN>>(16, 0, 2120);  // scales calibrated by the first request
}

TEST_CASE("a write that finds the device pool full gives back cached prefixes first", "[cuda][device_cache][prefix]") {
  const ModelShape shape{2, 4, 2, 64};
  CacheConfig config = window_config(16, 0, 0);
  config.prefix_sharing = PrefixSharing{"prefix-test"};
  // Three pages per stream for a prompt of 3 pages and 5 tokens: the pool holds one such request.
  gpu::DeviceKVCache<quant::Q4_0> device(shape, config, 12);
  const index_t length = 3 * 16 + 5;
  std::vector<paging::TokenId> first(static_cast<std::size_t>(length)), second(first.size());
  for (index_t i = 0; i < length; ++i) {
    first[i] = i;
    second[i] = 500 + i;
  }
  const PromptRows rows(shape, length, 2200);
  const auto prefill = [&](const std::vector<paging::TokenId>& prompt) {
    const PrefixHit hit = device.add_sequence(prompt);
    for (index_t layer = 0; layer < 2; ++layer) {
      const gpu::DeviceBuffer<float> keys{std::span<const float>(rows.keys[layer])};
      const gpu::DeviceBuffer<float> values{std::span<const float>(rows.values[layer])};
      device.prefill(hit.seq, layer, std::span<const float>(keys.data(), rows.keys[layer].size()),
                     std::span<const float>(values.data(), rows.values[layer].size()));
    }
    gpu::check(cudaDeviceSynchronize(), "prefill");
    return hit;
  };
  const PrefixHit a = prefill(first);
  CHECK(a.cached_tokens == 0);
  CHECK(device.pool().pages_in_use() == 12);
  device.release(a.seq);
  CHECK(device.prefix_stats().cached_pool_pages == 12);  // still held, by the index alone
  const PrefixHit b = prefill(second);  // needs all 12 pages: the cached ones go
  CHECK(b.cached_tokens == 0);
  CHECK(device.prefix_stats().evicted_pages == 3);
  CHECK(device.prefix_stats().cached_pool_pages == 0);
  CHECK(device.pool().pages_in_use() == 12);
  device.release(b.seq);
  const PrefixHit c = device.add_sequence(second);  // the second prompt is cached now
  CHECK(c.cached_tokens == 3 * 16);
  CHECK(device.pool().pages_in_use() == 12);  // shared, not copied
  device.release(c.seq);
  // A host sequence of 12 pages adopted into the full pool: the cached prefix makes room again.
  KVCache<layout::GQA, quant::Q4_0> host(shape, window_config(16, 0, 0));
  const SeqId on_host = host.add_sequence();
  for (index_t layer = 0; layer < 2; ++layer) {
    host.prefill(on_host, layer, std::span<const float>(rows.keys[layer]), std::span<const float>(rows.values[layer]));
  }
  const SeqId adopted = device.adopt(host, on_host);
  CHECK(device.prefix_stats().cached_pool_pages == 0);
  CHECK(device.pool().pages_in_use() == 12);
  for (index_t layer = 0; layer < 2; ++layer) check_twins(host, on_host, device, adopted, layer, 2300 + layer);
}

TEST_CASE("a cache created on the device rejects what it cannot do, and says why", "[cuda][device_cache]") {
  const ModelShape shape{1, 4, 2, 64};
  CacheConfig config;
  config.page_size = 32;
  gpu::DeviceKVCache<quant::Q4_0> cache(shape, config, 8);
  const SeqId seq = cache.add_sequence();
  const std::vector<float> host_rows(2 * 64, 1.0f);
  const gpu::DeviceBuffer<float> rows{std::span<const float>(host_rows)};
  const std::span<const float> device_rows(rows.data(), host_rows.size());
  gpu::DeviceBuffer<float> out(4 * 64);
  const std::span<float> device_out(out.data(), 4 * 64);
  const gpu::DeviceBuffer<float> query{std::span<const float>(std::vector<float>(4 * 64, 0.5f))};
  const std::span<const float> device_query(query.data(), 4 * 64);
  expect_error([&] { cache.prefill(seq, 0, std::span<const float>(host_rows), device_rows); },
               ErrorCode::kInvalidArgument, "keys is not device memory");
  expect_error([&] { cache.attend(seq, 0, device_query, device_out, 0.125f); }, ErrorCode::kInvalidArgument,
               "holds no tokens");
  cache.append(seq, 0, device_rows, device_rows, 7);
  expect_error([&] { cache.append(seq, 0, device_rows, device_rows, 7); }, ErrorCode::kInvalidArgument,
               "must be greater than the layer's last (7)");
  expect_error([&] { cache.append(seq, 1, device_rows, device_rows, 8); }, ErrorCode::kInvalidArgument,
               "layer 1 out of range");
  expect_error([&] { cache.append(seq + 1, 0, device_rows, device_rows, 8); }, ErrorCode::kUnknownSequence,
               "no sequence");
  expect_error([&] { cache.attend(seq, 0, device_rows, device_out, 0.125f); }, ErrorCode::kInvalidArgument,
               "q_heads * head_dim = 256");
  cache.attend(seq, 0, device_query, device_out, 0.125f);  // one token: its value row, all ones
  gpu::check(cudaDeviceSynchronize(), "attention");
  for (float x : out.download()) CHECK(x == Approx(1.0f).margin(0.05));  // q4_0 stores 1.0 within its step
  expect_error([&] { static_cast<void>(cache.read_back(seq, 0, 2)); }, ErrorCode::kInvalidArgument,
               "stream 2 out of range [0, 2)");
  CHECK(cache.read_back(seq, 0, 1).positions == std::vector<std::int32_t>{7});
  cache.release(seq);
  expect_error([&] { cache.release(seq); }, ErrorCode::kUnknownSequence, "no sequence");
  expect_error([&] { static_cast<void>(cache.read_back(seq, 0, 0)); }, ErrorCode::kUnknownSequence, "no sequence");
  // Static per-head FP8 scales made for another model (8 KV heads, 2 layers): the host cache
  // refuses them, and so does the device one (it handed heads the wrong rows before 2026-12-08).
  quant::FP8Options other_model;
  other_model.calibrate = false;
  other_model.granularity = quant::ScaleGranularity::kPerHead;
  other_model.kv_heads = 8;
  other_model.static_head_scales.assign(16, 1.0f);
  using FP8 = quant::FP8<quant::E4M3FN>;
  expect_error([&] { static_cast<void>(gpu::DeviceKVCache<FP8>(shape, config, 8, FP8(other_model))); },
               ErrorCode::kInvalidConfig, "static_head_scales hold 16 scales in rows of 8");
  // Options the device does not implement yet.
  CacheConfig rope = config;
  rope.key_rope = RopeSpec{};
  expect_error([&] { static_cast<void>(gpu::DeviceKVCache<quant::Q4_0>(shape, rope, 8)); }, ErrorCode::kUnsupported,
               "before RoPE");
  // Prefix sharing: off here; with an exact prefix (fp32 rows per sequence, which no page holds).
  const std::vector<paging::TokenId> prompt(40, 3);
  expect_error([&] { static_cast<void>(cache.add_sequence(prompt)); }, ErrorCode::kUnsupported,
               "set CacheConfig.prefix_sharing");
  const SeqId plain = cache.add_sequence();
  expect_error([&] { cache.share_prefix(plain); }, ErrorCode::kUnsupported, "prefix sharing is off");
  CacheConfig sharing = config;
  sharing.prefix_sharing = PrefixSharing{"m"};
  gpu::DeviceKVCache<quant::Q4_0> shared(shape, sharing, 8);
  const SeqId untokened = shared.add_sequence();
  expect_error([&] { shared.share_prefix(untokened); }, ErrorCode::kInvalidArgument, "was added without tokens");
  sharing.exact_prefix_tokens = 4;
  expect_error([&] { static_cast<void>(gpu::DeviceKVCache<quant::Q4_0>(shape, sharing, 8)); },
               ErrorCode::kUnsupported, "needs exact_prefix_tokens == 0, got 4");
}

int main(int argc, char** argv) {
  const kvpack::kernels::cuda::DeviceAvailability device = kvpack::kernels::cuda::device_availability();
  if (device.count == 0) {
    std::printf("SKIPPED: the CUDA kernel tests need a GPU (%s)\n", device.reason.c_str());
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
