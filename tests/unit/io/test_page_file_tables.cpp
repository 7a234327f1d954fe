// Page files of codecs whose parameters point into tables (KVQuant's calibration, TurboQuant's
// and QJL's seeded rotations and sketches): the file carries what the tables hold, a quantizer
// rebuilt from the file alone decodes and loads its pages bit for bit, and a cache or quantizer
// with other tables is refused by name instead of decoding the pages with the wrong ones.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvpack/io/page_file.hpp"
#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"
#include "unit/io/page_file_fixture.hpp"
#include "unit/io/page_file_surgery.hpp"
#include "unit/io/thrown_error.hpp"

namespace {

using namespace kvpack;
using CrossLayer2 = layout::CrossLayer<layout::GQA, 2>;
using TurboProd = quant::TurboQuant<7, quant::TurboVariant::kProd, quant::TurboVariant::kProd>;

enum class QNorm { kNo, kYes };

/// KVQuant tables for the test shape, calibrated on rows with outlier key channels; `seed`
/// changes the samples (so another calibration gives other tables).
std::shared_ptr<const quant::KVQuantTables> calibration(int bits, double outlier_fraction, QNorm q_norm,
                                                        std::uint32_t seed = 31) {
  using Calibrator = quant::KVQuantCalibrator;
  Calibrator::Options options;
  options.bits = bits;
  options.outlier_fraction = outlier_fraction;
  options.q_norm = q_norm == QNorm::kYes ? Calibrator::Options::QNorm::kAlways : Calibrator::Options::QNorm::kNever;
  const ModelShape& shape = test::kPageFileShape;
  Calibrator calibrator(shape, options);
  const std::size_t rows = 128 * static_cast<std::size_t>(shape.kv_heads);
  for (index_t layer = 0; layer < shape.layers; ++layer) {
    calibrator.add(layer, test::random_rows(rows, shape.head_dim, seed + 2 * layer, 4, 8.0f + layer),
                   test::random_rows(rows, shape.head_dim, seed + 2 * layer + 1));
  }
  return calibrator.finish();
}

/// A quantizer whose KVQuant planes (if any) hold a calibration.
template <class Q>
Q make_quantizer() {
  Q quantizer{};
  const auto calibrate = [](auto& codec) {
    if constexpr (requires { codec.tables; }) {
      codec.tables = calibration(std::remove_cvref_t<decltype(codec)>::kBits, 0.01, QNorm::kNo);
    }
  };
  calibrate(quantizer.key);
  calibrate(quantizer.value);
  return quantizer;
}

/// Writes a filled cache's sequence; checks every page against the cache and decodes it with
/// both the cache's quantizer and one rebuilt from the file; loads the file into a cache built
/// from the file alone, which writes the same bytes and attends as the original, bit for bit.
template <class Layout, class Q>
void table_round_trip(const Q& quantizer, CacheConfig config = {}) {
  using Cache = KVCache<Layout, Q>;
  const ModelShape& shape = test::kPageFileShape;
  Cache original(shape, config, quantizer);
  const SeqId seq = test::fill_sequence(original);
  const std::vector<std::byte> bytes = io::write_page_file(original, seq, {"test-model", {}});
  const io::PageFileView file = io::PageFileView::parse(bytes);
  const io::PageFileHeader& h = file.header();
  CHECK(h.payload_bytes == original.page_format_info().payload_bytes);
  const Q rebuilt = io::quantizer_from_file<Q>(file);

  const index_t d = shape.head_dim;
  std::vector<float> keys(static_cast<std::size_t>(h.page_size) * d), values(keys.size());
  std::vector<float> rebuilt_keys(keys.size()), rebuilt_values(keys.size());
  const Layout layout{};
  for (index_t c = 0; c < h.cache_layers; ++c) {
    const index_t writer = layout::writer_of(layout, shape, c);
    for (index_t s = 0; s < h.streams; ++s) {
      INFO("cache layer " << c << ", stream " << s);
      CHECK(io::read_codec_params<Q>(file, c, s, original.quantizer()) == original.codec_params(writer, s));
      const StoredTokens stored = original.read_back(seq, writer, s);
      const std::span<const PageId> ids = original.pages(seq, writer, s);
      REQUIRE(file.page_count(c, s) == ids.size());
      for (std::uint32_t p = 0; p < ids.size(); ++p) {
        CHECK(test::same_planes(h, file.payload(c, s, p).data(), original.pool().payload(ids[p])));
        io::decode_page<Q>(file, c, s, p, keys.data(), values.data(), original.quantizer());
        io::decode_page<Q>(file, c, s, p, rebuilt_keys.data(), rebuilt_values.data(), rebuilt);
        const std::size_t first = static_cast<std::size_t>(p) * h.page_size * d;
        // read_back rotates keys stored before RoPE; the file holds them as stored.
        if (!config.key_rope) CHECK(std::memcmp(keys.data(), stored.keys.data() + first, keys.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(values.data(), stored.values.data() + first, values.size() * sizeof(float)) == 0);
        CHECK(rebuilt_keys == keys);
        CHECK(rebuilt_values == values);
      }
    }
  }

  for (const PageCheck check : {PageCheck::kReencode, PageCheck::kStructure}) {
    INFO("PageCheck " << static_cast<int>(check));
    Cache loaded(shape, config, io::quantizer_from_file<Q>(file));
    const SeqId copy = io::load_page_file(loaded, file, check);
    CHECK(io::write_page_file(loaded, copy, {"test-model", {}}) == bytes);
    test::check_same_attention(original, seq, loaded, copy);
  }
  // The source cache's own quantizer loads it too.
  const SeqId again = io::load_page_file(original, file);
  CHECK(io::write_page_file(original, again, {"test-model", {}}) == bytes);
}

template <class Cache>
Error failed_load(Cache& cache, std::span<const std::byte> bytes) {
  const std::size_t pages = cache.memory().pages_in_use;
  const auto error = test::thrown_error([&] { (void)io::load_page_file(cache, io::PageFileView::parse(bytes)); });
  REQUIRE(error);
  CHECK(cache.memory().pages_in_use == pages);
  return *error;
}

Error parse_error(std::span<const std::byte> bytes) {
  const auto error = test::thrown_error([&] { (void)io::PageFileView::parse(bytes); });
  REQUIRE(error);
  return *error;
}

template <class Q>
std::vector<std::byte> file_of(const Q& quantizer) {
  KVCache<layout::GQA, Q> cache(test::kPageFileShape, {}, quantizer);
  return io::write_page_file(cache, test::fill_sequence(cache));
}

/// The file with `value` stored at byte `at` of PARM's body, checksums resealed.
template <class T>
std::vector<std::byte> with_params_edit(std::span<const std::byte> file, std::size_t at, T value) {
  return test::with_section(file, 1, [&](std::vector<std::byte> body) {
    std::memcpy(body.data() + at, &value, sizeof(value));
    return body;
  });
}

}  // namespace

TEMPLATE_TEST_CASE("table codecs' page files rebuild their quantizer and load back bit for bit", "[io][page_file]",
                   quant::KVQuant<2>, quant::KVQuant<3>, quant::KVQuant<4>, quant::TurboQuant<8>, TurboProd,
                   quant::QJL<>, (quant::Mixed<quant::Q8_0, quant::KVQuant<3>>)) {
  const TestType quantizer = make_quantizer<TestType>();
  SECTION("GQA") { table_round_trip<layout::GQA>(quantizer); }
  SECTION("CrossLayer<GQA, 2>") { table_round_trip<CrossLayer2>(quantizer); }
}

TEST_CASE("KVQuant page files carry Q-Norm rounding levels, outlier fractions and pre-RoPE keys", "[io][page_file]") {
  SECTION("Q-Norm, 2 bits") { table_round_trip<layout::GQA>(quant::KVQuant<2>(calibration(2, 0.01, QNorm::kYes))); }
  SECTION("5 % outliers: larger planes") {
    const quant::KVQuant<3> quantizer(calibration(3, 0.05, QNorm::kNo), 0.05);
    table_round_trip<layout::GQA>(quantizer);
    const std::vector<std::byte> wide = file_of(quantizer);
    const std::vector<std::byte> narrow = file_of(quant::KVQuant<3>(calibration(3, 0.01, QNorm::kNo), 0.01));
    CHECK(io::PageFileView::parse(wide).header().key_plane_bytes >
          io::PageFileView::parse(narrow).header().key_plane_bytes);
  }
  SECTION("keys before RoPE, the published configuration") {
    CacheConfig config;
    config.key_rope = RopeSpec{};
    table_round_trip<layout::GQA>(quant::KVQuant<3>(calibration(3, 0.01, QNorm::kNo)), config);
  }
  SECTION("TurboQuant with the dense rotation and another base seed") {
    quant::TurboQuant<6> quantizer;
    quantizer.key = quant::TurboQuant<6>::key_codec({quant::TurboQuant<6>::kRate, quant::RotationKind::kDense, 12345});
    table_round_trip<layout::GQA>(quantizer);
    const std::vector<std::byte> bytes = file_of(quantizer);  // the view borrows these bytes
    const io::PageFileView file = io::PageFileView::parse(bytes);
    CHECK(io::quantizer_from_file<quant::TurboQuant<6>>(file).key.options() == quantizer.key.options());
  }
}

TEST_CASE("a cache or quantizer with other tables than the file's is refused", "[io][page_file]") {
  SECTION("KVQuant: another calibration") {
    const std::vector<std::byte> bytes = file_of(quant::KVQuant<3>(calibration(3, 0.01, QNorm::kNo)));
    KVCache<layout::GQA, quant::KVQuant<3>> other(test::kPageFileShape, {},
                                                   quant::KVQuant<3>(calibration(3, 0.01, QNorm::kNo, 77)));
    (void)test::fill_sequence(other);
    const Error error = failed_load(other, bytes);
    CHECK(error.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(error.what(), Catch::Contains("other nuq3_key parameters"));
    // Decoding needs the tables: the default quantizer has none.
    const io::PageFileView file = io::PageFileView::parse(bytes);
    std::vector<float> rows(static_cast<std::size_t>(32 * 64));
    const auto missing = test::thrown_error([&] { io::decode_page<quant::KVQuant<3>>(file, 0, 0, 0, rows.data(), rows.data()); });
    REQUIRE(missing);
    CHECK(missing->code() == ErrorCode::kInvalidConfig);
  }
  SECTION("KVQuant: another outlier fraction") {
    const std::vector<std::byte> bytes = file_of(quant::KVQuant<3>(calibration(3, 0.01, QNorm::kNo)));
    // The same tables without the calibration's record of its fraction (as if built by hand),
    // so that only the fraction differs.
    auto unrecorded = std::make_shared<quant::KVQuantTables>(*calibration(3, 0.01, QNorm::kNo));
    unrecorded->outlier_fraction.reset();
    KVCache<layout::GQA, quant::KVQuant<3>> other(test::kPageFileShape, {}, quant::KVQuant<3>(unrecorded, 0.02));
    CHECK(failed_load(other, bytes).code() == ErrorCode::kInvalidArgument);
  }
  SECTION("TurboQuant: another seed") {
    const std::vector<std::byte> bytes = file_of(quant::TurboQuant<8>{});
    quant::TurboQuant<8> reseeded;
    reseeded.value = quant::TurboQuant<8>::value_codec({quant::TurboQuant<8>::kRate, quant::RotationKind::kAuto, 99});
    KVCache<layout::GQA, quant::TurboQuant<8>> other(test::kPageFileShape, {}, reseeded);
    const Error error = failed_load(other, bytes);
    CHECK(error.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(error.what(), Catch::Contains("other turbo_mse_value parameters"));
  }
  SECTION("QJL: another sketch size") {
    const std::vector<std::byte> bytes = file_of(quant::QJL<>{});
    KVCache<layout::GQA, quant::QJL<64>> other(test::kPageFileShape);
    CHECK(failed_load(other, bytes).code() == ErrorCode::kUnsupported);  // another quantizer name
    quant::QJL<> wider;
    wider.key = quant::QjlKeyCodec(64);
    KVCache<layout::GQA, quant::QJL<>> same_name(test::kPageFileShape, {}, wider);
    CHECK(failed_load(same_name, bytes).code() == ErrorCode::kInvalidArgument);
  }
}

TEST_CASE("table codecs' PARM records are checked before anything reads them", "[io][page_file]") {
  // PARM's body: 16 bytes of kinds and sizes, then per (layer, stream) the key record, then the
  // value record. KVQuant key record: f64 outlier fraction, u32 Q-Norm flag, u32 zero,
  // codebook (u32 size, 16 f32), rounding codebook, f32 offset[64], f32 half_range[64].
  const std::vector<std::byte> kvquant = file_of(quant::KVQuant<3>(calibration(3, 0.01, QNorm::kNo)));
  const std::size_t key = 16, codebook = key + 16, ranges = key + 16 + 2 * 68;
  const auto rejected = [](std::span<const std::byte> bytes, const std::string& words) {
    const Error error = parse_error(bytes);
    INFO(error.what());
    CHECK(error.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(error.what(), Catch::Contains(words));
  };
  REQUIRE_NOTHROW(io::PageFileView::parse(kvquant));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  SECTION("KVQuant key ranges") {
    rejected(with_params_edit(kvquant, ranges + 4 * 5, nan), "key range");
    rejected(with_params_edit(kvquant, ranges + 4 * (64 + 7), 0.0f), "key range");
    rejected(with_params_edit(kvquant, ranges + 4 * (64 + 7), -1.0f), "key range");
    rejected(with_params_edit(kvquant, ranges + 4 * (64 + 7), 1e6f), "key range");
    rejected(with_params_edit(kvquant, ranges + 4 * 5, -7e4f), "key range");
    const std::vector<std::byte> lowest_half = with_params_edit(kvquant, ranges + 4 * 5, -65504.0f);
    CHECK_NOTHROW(io::PageFileView::parse(lowest_half));
  }
  SECTION("KVQuant codebooks") {
    rejected(with_params_edit(kvquant, codebook, std::uint32_t{16}), "codebook of another size");
    rejected(with_params_edit(kvquant, codebook + 4 + 4 * 3, nan), "codebook level that is not finite");
    // The last level of 8 (the highest): beyond ±64, then at 64.
    rejected(with_params_edit(kvquant, codebook + 4 + 4 * 7, 65.0f), "codebook level that is not finite");
    const std::vector<std::byte> level_at_limit = with_params_edit(kvquant, codebook + 4 + 4 * 7, 64.0f);
    CHECK_NOTHROW(io::PageFileView::parse(level_at_limit));
    rejected(with_params_edit(kvquant, codebook + 4 + 4 * 12, 0.5f), "non-zero unused one");
    rejected(with_params_edit(kvquant, codebook + 4, 2.0f), "unsorted levels");
    rejected(with_params_edit(kvquant, key + 8, std::uint32_t{2}), "Q-Norm flag");
  }
  SECTION("KVQuant outlier fraction: in range, and the same in every record") {
    rejected(with_params_edit(kvquant, key, 0.5), "outlier fraction");
    rejected(with_params_edit(kvquant, key, std::numeric_limits<double>::quiet_NaN()), "outlier fraction");
    rejected(with_params_edit(kvquant, key, 0.02), "disagree on the codec's options");
  }
  SECTION("QJL seeds and padding") {
    const std::vector<std::byte> qjl = file_of(quant::QJL<>{});
    REQUIRE_NOTHROW(io::PageFileView::parse(qjl));
    // QJL key record: u32 sketch rows, u32 zero, u64 base seed, u32 layer, u32 zero, u64 seed.
    rejected(with_params_edit(qjl, 16 + 4, std::uint32_t{1}), "non-zero padding");
    rejected(with_params_edit(qjl, 16, std::uint32_t{0xFFFFFFFF}), "more sketch rows");
    rejected(with_params_edit(qjl, 16 + 24, std::uint64_t{5}), "seed that is not the layer's");
  }
  SECTION("TurboQuant seeds and options") {
    const std::vector<std::byte> turbo = file_of(quant::TurboQuant<8>{});
    REQUIRE_NOTHROW(io::PageFileView::parse(turbo));
    // Turbo record: u32 rotation, i32 high bits, i32 low bits, u32 zero, f64 share, u64 base
    // seed, u32 layer, u32 zero, u64 layer seed (48 bytes); the second stream's starts at 16 + 96.
    rejected(with_params_edit(turbo, 16 + 40, std::uint64_t{1}), "seed that is not the layer's");
    rejected(with_params_edit(turbo, 16 + 32, std::uint32_t{1}), "seed that is not the layer's");
    rejected(with_params_edit(turbo, 16, std::uint32_t{7}), "unknown rotation kind");
    rejected(with_params_edit(turbo, 16 + 12, std::uint32_t{1}), "non-zero padding");
    rejected(with_params_edit(turbo, 16 + 36, std::uint32_t{1}), "seed that is not the layer's");
    rejected(with_params_edit(turbo, 16 + 16, std::numeric_limits<double>::infinity()), "non-finite share");
    rejected(with_params_edit(turbo, 16 + 96 + 4, std::int32_t{3}), "disagree on the codec's options");
    // All records at 5 bits: the codec's own check.
    std::vector<std::byte> five = turbo;
    five = test::with_section(five, 1, [](std::vector<std::byte> body) {
      for (std::size_t at = 16; at < body.size(); at += 48) {
        const std::int32_t bits = 5;
        std::memcpy(body.data() + at + 4, &bits, 4);
        std::memcpy(body.data() + at + 8, &bits, 4);
      }
      return body;
    });
    CHECK(parse_error(five).code() == ErrorCode::kUnsupported);
  }
}

TEST_CASE("a KVQuant page whose outlier section leaves the page is refused before it is decoded", "[io][page_file]") {
  // Page 0's key plane: 3-bit codes, 12 bytes per channel row x 64 channels, then the outlier
  // section (u16 count, u16 indices, fp16 values). Decoding writes row elements at the indices,
  // so an index past the page's 32 x 64 elements would write outside it.
  using Q = quant::KVQuant<3>;
  const Q quantizer(calibration(3, 0.01, QNorm::kNo));
  const std::vector<std::byte> bytes = file_of(quantizer);
  const std::size_t outliers = quant::KVQuantKeyCodec<3>::outliers_offset({32, 64});
  const auto with_outliers = [&](std::uint16_t count, std::uint16_t index) {
    return test::with_section(bytes, 4, [&](std::vector<std::byte> body) {
      std::memcpy(body.data() + outliers, &count, 2);
      std::memcpy(body.data() + outliers + 2, &index, 2);
      return body;
    });
  };
  const std::size_t capacity = quant::kvquant_detail::outlier_capacity(0.01, {32, 64});
  for (const auto& [count, index] : {std::pair<std::uint16_t, std::uint16_t>{1, 2048}, {1, 65535},
                                     {static_cast<std::uint16_t>(capacity + 1), 0}}) {
    INFO("count " << count << ", index " << index);
    for (const PageCheck check : {PageCheck::kReencode, PageCheck::kFinite}) {
      KVCache<layout::GQA, Q> cache(test::kPageFileShape, {}, quantizer);
      const std::vector<std::byte> bad = with_outliers(count, index);
      const auto error =
          test::thrown_error([&] { (void)io::load_page_file(cache, io::PageFileView::parse(bad), check); });
      REQUIRE(error);
      CHECK(error->code() == ErrorCode::kInvalidArgument);
      CHECK_THAT(error->what(), Catch::Contains("outlier section"));
      CHECK(cache.memory().pages_in_use == 0);
    }
  }
  // The last element of the page is inside it.
  KVCache<layout::GQA, Q> cache(test::kPageFileShape, {}, quantizer);
  const std::vector<std::byte> last_element = with_outliers(1, 2047);
  CHECK_NOTHROW(io::load_page_file(cache, io::PageFileView::parse(last_element), PageCheck::kFinite));
}
