// Page files round trip every covered codec × layout: the pages read back are the pool's bytes,
// slot for slot, the codec parameters are the cache's, and decoding the pages with the codec gives
// exactly what read_back gives. A mapped file reads the same as the buffer, without copies.
// load_page_file puts a file back into a cache: the loaded sequence writes the same file again
// and attends exactly as the original; what it cannot load leaves the cache as it was.

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <unistd.h>
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

/// Every page of the file against the cache it was written from.
template <class Cache>
void check_round_trip(const Cache& cache, SeqId seq, const io::PageFileView& file) {
  using Q = typename Cache::quantizer_type;
  const io::PageFileHeader& h = file.header();
  const typename Cache::layout_type layout{};
  const ModelShape& shape = cache.shape();
  REQUIRE(h.cache_layers == layout::cache_layers(layout, shape));
  REQUIRE(h.streams == shape.kv_heads);
  CHECK(h.shape.layers == shape.layers);
  CHECK(h.shape.q_heads == shape.q_heads);
  CHECK(h.shape.head_dim == shape.head_dim);
  CHECK(h.page_size == cache.config().page_size);
  CHECK(h.layout == Cache::layout_type::kName);
  CHECK(h.quantizer == Q::name());
  CHECK(h.payload_bytes == cache.page_format_info().payload_bytes);
  const index_t tokens = test::page_file_tokens(cache.config());
  CHECK(h.sequence_tokens == static_cast<std::uint64_t>(tokens));
  io::check_quantizer<Q>(h);

  const index_t d = shape.head_dim, page_size = h.page_size;
  std::vector<float> keys(static_cast<std::size_t>(page_size) * d), values(keys.size());
  for (index_t c = 0; c < h.cache_layers; ++c) {
    const index_t writer = layout::writer_of(layout, shape, c);
    for (index_t s = 0; s < h.streams; ++s) {
      INFO("cache layer " << c << ", stream " << s);
      const std::span<const PageId> ids = cache.pages(seq, writer, s);
      REQUIRE(file.page_count(c, s) == ids.size());
      REQUIRE(ids.size() * page_size == static_cast<std::size_t>(tokens));
      CHECK(io::read_codec_params<Q>(file, c, s) == cache.codec_params(writer, s));

      const StoredTokens stored = cache.read_back(seq, writer, s);
      REQUIRE(stored.size() == tokens);
      for (std::uint32_t p = 0; p < ids.size(); ++p) {
        const std::span<const std::byte> payload = file.payload(c, s, p);
        REQUIRE(payload.size() == h.payload_bytes);
        CHECK(test::same_planes(h, payload.data(), cache.pool().payload(ids[p])));
        io::decode_page<Q>(file, c, s, p, keys.data(), values.data());
        const std::size_t first = static_cast<std::size_t>(p) * page_size;
        for (index_t t = 0; t < page_size; ++t) {
          CHECK(file.live(c, s, p, t));
          CHECK(file.position(c, s, p, t) == stored.positions[first + t]);
        }
        // Bit-identical: read_back runs the same scalar decoders on the same bytes.
        CHECK(std::memcmp(keys.data(), stored.keys.data() + first * d, keys.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(values.data(), stored.values.data() + first * d, values.size() * sizeof(float)) == 0);
      }
    }
  }
}

template <class Cache>
void round_trip(CacheConfig config = {}) {
  Cache cache(test::kPageFileShape, config);
  const SeqId seq = test::fill_sequence(cache);
  const std::vector<std::int32_t> tokens = test::token_ids(test::page_file_tokens(config));
  io::PageFileOptions options;
  options.model_id = "test-model/3x4x2x64";
  options.tokens = tokens;
  const std::vector<std::byte> bytes = io::write_page_file(cache, seq, options);
  CHECK(bytes.size() % io::kPageFileAlignment == 0);
  const io::PageFileView file = io::PageFileView::parse(bytes);
  CHECK(file.header().model_id == options.model_id);
  CHECK(std::vector<std::int32_t>(file.tokens().begin(), file.tokens().end()) == tokens);
  check_round_trip(cache, seq, file);
}

/// Loads the file of a filled cache's sequence into a fresh cache of the same type (behind
/// another sequence), at every PageCheck: the loaded sequence writes the same bytes, so it holds
/// the same pages, positions, live masks and codec parameters (attention over it is then the
/// original's; the cases below check that too). Loaded alone, it counts in memory() as the
/// original does.
template <class Cache>
void load_round_trip(CacheConfig config = {}) {
  Cache original(test::kPageFileShape, config);
  const SeqId seq = test::fill_sequence(original);
  const std::vector<std::int32_t> tokens = test::token_ids(test::page_file_tokens(config));
  const io::PageFileOptions options{"test-model/3x4x2x64", tokens};
  const std::vector<std::byte> bytes = io::write_page_file(original, seq, options);
  // A calibrating codec's cache takes the file's parameters only before its own first prefill.
  constexpr bool kCalibrates = quant::CalibratedCodec<typename Cache::quantizer_type::key_codec>;
  for (const PageCheck check : {PageCheck::kReencode, PageCheck::kFinite, PageCheck::kStructure}) {
    INFO("PageCheck " << static_cast<int>(check));
    Cache loaded(test::kPageFileShape, config);
    if (!kCalibrates) (void)test::fill_sequence(loaded, 11);
    const SeqId copy = io::load_page_file(loaded, io::PageFileView::parse(bytes), check);
    CHECK(io::write_page_file(loaded, copy, options) == bytes);
    if constexpr (kCalibrates) {
      // The file's scales are the layers' now: a prefill of other data keeps them.
      (void)test::fill_sequence(loaded, 11);
      for (index_t layer = 0; layer < test::kPageFileShape.layers; ++layer) {
        CHECK(loaded.codec_params(layer, 1) == original.codec_params(layer, 1));
      }
    }
    if constexpr (std::is_same_v<typename Cache::quantizer_type, quant::KIVI<2, 64>>) {
      test::check_same_attention(original, seq, loaded, copy);  // keys before RoPE: rotated at read
    }
  }
  Cache alone(test::kPageFileShape, config);
  (void)io::load_page_file(alone, io::PageFileView::parse(bytes), PageCheck::kStructure);
  CHECK(alone.memory().pages_in_use == original.memory().pages_in_use);
  CHECK(alone.memory().stored_elements == original.memory().stored_elements);
  CHECK(alone.memory().tails == original.memory().tails);
}

/// The error load_page_file throws for `bytes` into `cache`, after checking the cache is as it was.
template <class Cache>
Error failed_load(Cache& cache, const std::vector<std::byte>& bytes, PageCheck check = PageCheck::kReencode) {
  const std::size_t pages = cache.memory().pages_in_use, total = cache.memory().total();
  const auto error =
      test::thrown_error([&] { (void)io::load_page_file(cache, io::PageFileView::parse(bytes), check); });
  REQUIRE(error);
  CHECK(cache.memory().pages_in_use == pages);
  CHECK(cache.memory().total() == total);
  return *error;
}

}  // namespace

TEMPLATE_TEST_CASE("page files load back into a cache bit for bit, every covered codec", "[io][page_file]",
                   quant::Float<float>, quant::Float<half>, quant::Float<bfloat16>, quant::FP8<quant::E4M3FN>,
                   quant::FP8<quant::E5M2>, quant::Int8, quant::Q8_0,
                   quant::Q4_0, (quant::Mixed<quant::Q8_0, quant::Q4_0>), quant::KIVI<2>, quant::KIVI<4>,
                   (quant::KiviPerTokenKeys<4, 32>)) {
  load_round_trip<KVCache<layout::GQA, TestType>>();
}

// The layout only decides which model layer writes each cache layer, whatever the codec: two
// codecs (one per-token, one per-channel) stand for the rest (and keep the test's compile time down).
TEMPLATE_TEST_CASE("page files load back into a CrossLayer<GQA, 2> cache bit for bit", "[io][page_file]",
                   quant::Q4_0, quant::KIVI<2>) {
  load_round_trip<KVCache<CrossLayer2, TestType>>();
}

TEST_CASE("page files load back with keys before RoPE and with positions that skip", "[io][page_file]") {
  SECTION("pre-RoPE keys, KIVI groups of 64") {
    CacheConfig config;
    config.page_size = 64;
    config.key_rope = RopeSpec{500000.0, RopePairing::kHalfSplit, 4096};
    load_round_trip<KVCache<layout::GQA, quant::KIVI<2, 64>>>(config);
  }
  SECTION("appended tokens at every third position: the loader appends them at theirs") {
    KVCache<layout::GQA, quant::Q4_0> original(test::kPageFileShape);
    const SeqId seq = original.add_sequence();
    const ModelShape& shape = test::kPageFileShape;
    const std::size_t row = static_cast<std::size_t>(shape.kv_heads) * shape.head_dim;
    const index_t tokens = test::page_file_tokens(original.config());
    for (index_t layer = 0; layer < shape.layers; ++layer) {
      const std::vector<float> keys = test::random_rows(tokens * shape.kv_heads, shape.head_dim, 3 + layer, 4);
      const std::vector<float> values = test::random_rows(tokens * shape.kv_heads, shape.head_dim, 5 + layer);
      for (index_t t = 0; t < tokens; ++t) {
        original.append(seq, layer, std::span<const float>(keys).subspan(t * row, row),
                        std::span<const float>(values).subspan(t * row, row), 3 * t + 1);
      }
    }
    const std::vector<std::byte> bytes = io::write_page_file(original, seq);
    KVCache<layout::GQA, quant::Q4_0> loaded(test::kPageFileShape);
    const SeqId copy = io::load_page_file(loaded, io::PageFileView::parse(bytes));
    CHECK(io::write_page_file(loaded, copy) == bytes);
    CHECK(loaded.read_back(copy, 2, 1).positions == original.read_back(seq, 2, 1).positions);
    test::check_same_attention(original, seq, loaded, copy);
  }
}

TEST_CASE("load_page_file refuses what it cannot load exactly and leaves the cache as it was", "[io][page_file]") {
  KVCache<layout::GQA, quant::Q8_0> source(test::kPageFileShape);
  const std::vector<std::byte> bytes = io::write_page_file(source, test::fill_sequence(source));
  SECTION("another quantizer") {
    KVCache<layout::GQA, quant::Q4_0> cache(test::kPageFileShape);
    const Error error = failed_load(cache, bytes);
    CHECK(error.code() == ErrorCode::kUnsupported);
    CHECK_THAT(error.what(), Catch::Contains("q8_0"));
  }
  SECTION("another shape, layout or page size") {
    KVCache<layout::GQA, quant::Q8_0> wider(ModelShape{3, 8, 4, 64});
    CHECK_THAT(failed_load(wider, bytes).what(), Catch::Contains("is not the cache's (3, 8, 4, 64)"));
    KVCache<CrossLayer2, quant::Q8_0> shared(test::kPageFileShape);
    CHECK_THAT(failed_load(shared, bytes).what(), Catch::Contains("the file's layout is gqa"));
    CacheConfig config;
    config.page_size = 64;
    KVCache<layout::GQA, quant::Q8_0> larger_pages(test::kPageFileShape, config);
    CHECK(failed_load(larger_pages, bytes).code() == ErrorCode::kInvalidArgument);
  }
  SECTION("a cache with an exact prefix, or one that evicts, or other RoPE storage") {
    CacheConfig config;
    config.exact_prefix_tokens = 4;
    KVCache<layout::GQA, quant::Q8_0> exact(test::kPageFileShape, config);
    CHECK_THAT(failed_load(exact, bytes).what(), Catch::Contains("exact_prefix_tokens"));
    KVCache<layout::GQA, quant::Q8_0, evict::StreamingLLM<>> evicting(test::kPageFileShape);
    CHECK_THAT(failed_load(evicting, bytes).what(), Catch::Contains("evicting cache"));
    CacheConfig rope;
    rope.key_rope = RopeSpec{};
    KVCache<layout::GQA, quant::Q8_0> pre_rope(test::kPageFileShape, rope);
    CHECK_THAT(failed_load(pre_rope, bytes).what(), Catch::Contains("keys after RoPE, the cache before"));
  }
  SECTION("FP8 into a cache its own prefill calibrated with other scales") {
    KVCache<layout::GQA, quant::FP8<quant::E4M3FN>> fp8_source(test::kPageFileShape);
    const std::vector<std::byte> fp8 = io::write_page_file(fp8_source, test::fill_sequence(fp8_source));
    KVCache<layout::GQA, quant::FP8<quant::E4M3FN>> cache(test::kPageFileShape);
    (void)test::fill_sequence(cache, 11);
    const Error error = failed_load(cache, fp8);
    CHECK(error.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(error.what(), Catch::Contains("layer 0 stream 0 has other key codec parameters than the pages'"));
  }
  SECTION("a page its codec would not encode that way: refused by kReencode, kept as stored by kFinite") {
    // One code byte of the last layer's first page changed (and the file re-sealed): the page
    // still decodes, but code -128 lies beyond the 127 its scale was chosen for, so re-encoding
    // picks another scale.
    std::vector<std::byte> edited = bytes;
    const std::size_t pages_body = test::sections_of(edited).back().body;
    const std::size_t last_layer_page = 2 * test::kPageFileShape.kv_heads * 3;
    const std::size_t payload = io::PageFileView::parse(bytes).header().payload_bytes;
    edited[pages_body + last_layer_page * payload + 7] = std::byte{0x80};  // code -128: beyond the block's 127
    test::reseal(edited);
    KVCache<layout::GQA, quant::Q8_0> cache(test::kPageFileShape);
    const Error error = failed_load(cache, edited);
    CHECK(error.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(error.what(), Catch::Contains("layer 2 stream 0 page 0 (keys) is not what q8_0 encodes"));
    const SeqId kept = io::load_page_file(cache, io::PageFileView::parse(edited), PageCheck::kFinite);
    CHECK(io::write_page_file(cache, kept) == edited);
  }
  SECTION("a page that decodes to Inf (fuzz_page_file's first find, now named by the loader)") {
    KVCache<layout::GQA, quant::Float<half>> f16_source(test::kPageFileShape);
    std::vector<std::byte> f16 = io::write_page_file(f16_source, test::fill_sequence(f16_source));
    const std::size_t pages_body = test::sections_of(f16).back().body;
    f16[pages_body] = std::byte{0x00};
    f16[pages_body + 1] = std::byte{0x7C};  // fp16 +Inf in the first key element
    test::reseal(f16);
    KVCache<layout::GQA, quant::Float<half>> cache(test::kPageFileShape);
    for (const PageCheck check : {PageCheck::kReencode, PageCheck::kFinite}) {
      const Error error = failed_load(cache, f16, check);
      CHECK(error.code() == ErrorCode::kInvalidArgument);
      CHECK_THAT(error.what(), Catch::Contains("layer 0 stream 0 page 0 (keys) decodes to NaN or Inf"));
    }
    // kStructure trusts the bytes: the Inf is stored as it was written.
    const SeqId trusted = io::load_page_file(cache, io::PageFileView::parse(f16), PageCheck::kStructure);
    CHECK(std::isinf(cache.read_back(trusted, 0, 0).keys[0]));
  }
  SECTION("a pool too small: the pages taken so far go back") {
    CacheConfig config;
    config.max_pages = 10;  // the file holds 3 layers x 2 streams x 3 pages = 18
    KVCache<layout::GQA, quant::Q8_0> cache(test::kPageFileShape, config);
    CHECK(failed_load(cache, bytes).code() == ErrorCode::kOutOfPages);
  }
}

TEMPLATE_TEST_CASE("page files round trip every covered codec on GQA and CrossLayer", "[io][page_file]",
                   quant::Float<float>, quant::Float<half>, quant::Float<bfloat16>, quant::FP8<quant::E4M3FN>,
                   quant::FP8<quant::E5M2>, quant::Int8, quant::Q8_0, quant::Q4_0, (quant::Mixed<quant::Q8_0, quant::Q4_0>),
                   (quant::Mixed<quant::FP8<quant::E4M3FN>, quant::KIVI<2>>), quant::KIVI<2>, quant::KIVI<4>,
                   (quant::KiviPerTokenKeys<4, 32>)) {
  SECTION("GQA") { round_trip<KVCache<layout::GQA, TestType>>(); }
  SECTION("CrossLayer<GQA, 2>") { round_trip<KVCache<CrossLayer2, TestType>>(); }
}

TEST_CASE("page files record KIVI's group, which its codec names leave out", "[io][page_file]") {
  CacheConfig config;
  config.page_size = 64;  // KIVI<2, 64> quantizes keys in groups of 64 tokens
  round_trip<KVCache<layout::GQA, quant::KIVI<2, 64>>>(config);
  KVCache<layout::GQA, quant::KIVI<2, 64>> cache(test::kPageFileShape, config);
  const std::vector<std::byte> bytes = io::write_page_file(cache, test::fill_sequence(cache));
  const io::PageFileView file = io::PageFileView::parse(bytes);
  CHECK(file.header().key_group == 64);
  CHECK(file.header().key_codec == quant::KIVI<2, 32>::key_codec::kName);  // same name as group 32
  const auto error = test::thrown_error([&] { io::check_quantizer<quant::KIVI<2, 32>>(file.header()); });
  REQUIRE(error);
  CHECK(error->code() == ErrorCode::kUnsupported);
}

TEST_CASE("FP8 page files carry each layer's calibrated scales", "[io][page_file]") {
  // Guards the round trip above against passing vacuously with equal default scales.
  KVCache<layout::GQA, quant::FP8<quant::E4M3FN>> cache(test::kPageFileShape);
  const SeqId seq = test::fill_sequence(cache);
  const std::vector<std::byte> bytes = io::write_page_file(cache, seq);
  const io::PageFileView file = io::PageFileView::parse(bytes);
  const float first = io::read_codec_params<quant::FP8<quant::E4M3FN>>(file, 0, 0).first.scale;
  const float last = io::read_codec_params<quant::FP8<quant::E4M3FN>>(file, 2, 1).first.scale;
  CHECK(first != 1.0f);
  CHECK(first != last);
}

TEST_CASE("a mapped page file reads as its bytes, with payload views into the mapping", "[io][page_file]") {
  KVCache<layout::GQA, quant::Q8_0> cache(test::kPageFileShape);
  const SeqId seq = test::fill_sequence(cache);
  char path[] = "/tmp/kvpack_page_file_XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  io::write_page_file(path, cache, seq, {"mapped", {}});
  {
    const io::PageFile file(path);
    const io::PageFileView& view = file.view();
    CHECK(view.header().model_id == "mapped");
    CHECK(view.tokens().empty());
    check_round_trip(cache, seq, view);
    // Payloads are views: inside the mapping, at the 64-byte alignment the pool gives them.
    const std::byte* payload = view.payload(1, 1, 2).data();
    CHECK(reinterpret_cast<std::uintptr_t>(payload) % io::kPageFileAlignment == 0);
    const std::byte* other = view.payload(1, 1, 1).data();
    CHECK(payload - other == static_cast<std::ptrdiff_t>(view.header().payload_bytes));
  }
  std::remove(path);
}

TEST_CASE("page files stream to a descriptor: a pipe and a file get the bytes write_page_file returns", "[io][page_file]") {
  KVCache<layout::GQA, quant::Q8_0> cache(test::kPageFileShape);
  const SeqId seq = test::fill_sequence(cache);
  const std::vector<std::int32_t> tokens = test::token_ids(test::page_file_tokens(cache.config()));
  const io::PageFileOptions options{"streamed", tokens};
  const std::vector<std::byte> expected = io::write_page_file(cache, seq, options);
  REQUIRE(expected.size() > 65536);  // more than a pipe holds: the writer must wait for its reader
  int ends[2];
  REQUIRE(pipe(ends) == 0);
  std::vector<std::byte> received;
  std::thread reader([&] {
    std::byte buffer[4096];
    for (ssize_t n; (n = read(ends[0], buffer, sizeof buffer)) > 0;) received.insert(received.end(), buffer, buffer + n);
  });
  const std::uint64_t written = io::write_page_file(ends[1], cache, seq, options);
  close(ends[1]);
  reader.join();
  close(ends[0]);
  CHECK(written == expected.size());
  CHECK(received == expected);

  char path[] = "/tmp/kvpack_page_file_XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  io::write_page_file(path, cache, seq, options);
  {
    const io::MappedFile file(path);
    CHECK(std::equal(file.bytes().begin(), file.bytes().end(), expected.begin(), expected.end()));
  }
  std::remove(path);

  const auto bad_fd = test::thrown_error([&] { (void)io::write_page_file(-1, cache, seq, options); });
  REQUIRE(bad_fd);
  CHECK(bad_fd->code() == ErrorCode::kUnavailable);
  CHECK_THAT(bad_fd->what(), Catch::Contains("Bad file descriptor"));
  const auto bad_path = test::thrown_error([&] { io::write_page_file("/nonexistent/dir/file", cache, seq, options); });
  REQUIRE(bad_path);
  CHECK(bad_path->code() == ErrorCode::kInvalidArgument);
}

TEST_CASE("page files record keys stored before RoPE", "[io][page_file]") {
  CacheConfig config;
  config.key_rope = RopeSpec{500000.0, RopePairing::kHalfSplit, 4096};
  KVCache<layout::GQA, quant::Float<half>> cache(test::kPageFileShape, config);
  const SeqId seq = test::fill_sequence(cache);
  const std::vector<std::byte> bytes = io::write_page_file(cache, seq);
  const io::PageFileView file = io::PageFileView::parse(bytes);
  CHECK(file.header().keys_before_rope);
  CHECK(file.header().rope_theta == 500000.0);
  CHECK(file.header().rope_pairing == static_cast<std::uint32_t>(RopePairing::kHalfSplit));
  CHECK(file.header().rope_max_position == 4096);
  const std::span<const PageId> ids = cache.pages(seq, 2, 1);
  CHECK(test::same_planes(file.header(), file.payload(2, 1, 0).data(), cache.pool().payload(ids[0])));

  KVCache<layout::GQA, quant::Float<half>> plain(test::kPageFileShape);
  const std::vector<std::byte> plain_bytes = io::write_page_file(plain, test::fill_sequence(plain));
  CHECK_FALSE(io::PageFileView::parse(plain_bytes).header().keys_before_rope);
}

TEST_CASE("the writer rejects what page files cannot carry yet", "[io][page_file]") {
  SECTION("tokens in the full-precision tail") {
    CacheConfig config;
    config.tail_tokens = 32;
    KVCache<layout::GQA, quant::Q8_0> cache(test::kPageFileShape, config);
    const SeqId seq = test::fill_sequence(cache);
    const auto error = test::thrown_error([&] { (void)io::write_page_file(cache, seq); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kUnsupported);
    CHECK_THAT(error->what(), Catch::Contains("whole pages only"));
  }
  SECTION("an unknown sequence") {
    KVCache<layout::GQA, quant::Q8_0> cache(test::kPageFileShape);
    const auto error = test::thrown_error([&] { (void)io::write_page_file(cache, SeqId{42}); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kUnknownSequence);
  }
}

TEST_CASE("MLA page files record the latent and RoPE widths and load back bit for bit", "[io][page_file][mla]") {
  using Cache = KVCache<layout::MLA, quant::MLA<quant::Q8_0>>;
  const ModelShape shape{2, 8, 1, 128};
  CacheConfig config;
  config.page_size = 16;
  const layout::MLA mla{64, 32};
  Cache original(shape, config, {}, mla);
  const SeqId seq = original.add_sequence();
  for (index_t layer = 0; layer < shape.layers; ++layer) {
    const auto rope = test::random_rows(48, 32, 200 + static_cast<std::uint32_t>(layer));
    const auto latent = test::random_rows(48, 64, 210 + static_cast<std::uint32_t>(layer));
    original.prefill(seq, layer, std::span<const float>(rope), std::span<const float>(latent));
  }
  const std::vector<std::byte> bytes = io::write_page_file(original, seq);
  const io::PageFileView file = io::PageFileView::parse(bytes);
  CHECK(file.header().layout == "mla");
  CHECK(file.header().streams == 1);
  CHECK(file.header().key_dim == 32);
  CHECK(file.header().value_dim == 64);

  Cache loaded(shape, config, {}, mla);
  const SeqId copy = io::load_page_file(loaded, file);
  CHECK(io::write_page_file(loaded, copy) == bytes);
  const std::vector<float> query = test::random_rows(8, 96, 220);
  std::vector<float> expected(8 * 64), got(8 * 64);
  for (index_t layer = 0; layer < shape.layers; ++layer) {
    original.attend(seq, layer, std::span<const float>(query), std::span<float>(expected), 0.1f);
    loaded.attend(copy, layer, std::span<const float>(query), std::span<float>(got), 0.1f);
    CHECK(std::memcmp(expected.data(), got.data(), got.size() * sizeof(float)) == 0);
  }

  // Another latent width is another cache: refused, nothing written.
  Cache wider(shape, config, {}, layout::MLA{96, 32});
  CHECK_THAT(failed_load(wider, bytes).what(), Catch::Contains("rows are 32 and 64 wide, the cache's 32 and 96"));
}

namespace {

/// Page p of stream s of `layer` in `cache`'s sequence `seq`, as append_encoded_pages takes it.
template <class Cache>
EncodedPage held_page(const Cache& cache, SeqId seq, index_t layer, index_t s, std::size_t p) {
  const PageId id = cache.pages(seq, layer, s)[p];
  const std::size_t slot_bytes = static_cast<std::size_t>(cache.config().page_size) * 4 +
                                 static_cast<std::size_t>(cache.config().page_size + 63) / 64 * 8;
  return {{cache.pool().payload(id), cache.page_format_info().payload_bytes}, {cache.pool().metadata(id), slot_bytes}};
}

}  // namespace

TEST_CASE("append_encoded_pages takes another cache's pages and refuses bytes it cannot trust", "[io][page_file]") {
  using Cache = KVCache<layout::GQA, quant::Q8_0>;
  Cache source(test::kPageFileShape);
  const SeqId seq = test::fill_sequence(source);
  auto from_source = [&](index_t layer) {
    return [&, layer](index_t s, std::size_t p) { return held_page(source, seq, layer, s, p); };
  };
  Cache cache(test::kPageFileShape);
  const SeqId target = cache.add_sequence();
  const std::size_t total = cache.memory().total();
  // Runs one call that must throw, and checks it left the cache as it was.
  auto refused = [&](auto call) {
    const auto error = test::thrown_error(call);
    REQUIRE(error);
    CHECK(cache.memory().total() == total);
    CHECK(cache.length(target, 0) == 0);
    return *error;
  };

  SECTION("pages another cache encoded attend as they did there") {
    for (index_t layer = 0; layer < test::kPageFileShape.layers; ++layer) {
      cache.append_encoded_pages(target, layer, 3, from_source(layer));
    }
    test::check_same_attention(source, seq, cache, target);
    CHECK(cache.length(target, 1) == source.length(seq, 1));
  }
  SECTION("the structure of every page") {
    std::vector<std::byte> slots(held_page(source, seq, 0, 0, 0).slots.begin(), held_page(source, seq, 0, 0, 0).slots.end());
    const auto with_slots = [&](index_t s, std::size_t p) {
      EncodedPage page = held_page(source, seq, 0, s, p);
      if (s == 1 && p == 0) page.slots = slots;
      return page;
    };
    const auto call = [&] { cache.append_encoded_pages(target, 0, 3, with_slots); };
    std::int32_t position = 99;
    std::memcpy(slots.data() + 5 * 4, &position, 4);
    CHECK_THAT(refused(call).what(), Catch::Contains("layer 0 stream 1 page 0 slot 5 is at position 99, stream 0's at 5"));
    position = 5;
    std::memcpy(slots.data() + 5 * 4, &position, 4);
    slots[cache.config().page_size * 4] = std::byte{0xFE};  // slot 0 dead
    CHECK_THAT(refused(call).what(), Catch::Contains("stream 1 page 0 has dead slots"));
    const auto short_payload = [&](index_t s, std::size_t p) {
      EncodedPage page = held_page(source, seq, 0, s, p);
      page.payload = page.payload.first(page.payload.size() - 1);
      return page;
    };
    CHECK(refused([&] { cache.append_encoded_pages(target, 0, 3, short_payload); }).code() ==
          ErrorCode::kInvalidArgument);
    // Pages 1 and 2 before page 0: positions that go backwards.
    const auto reversed = [&](index_t s, std::size_t p) { return held_page(source, seq, 0, s, 2 - p); };
    CHECK_THAT(refused([&] { cache.append_encoded_pages(target, 0, 3, reversed); }).what(),
               Catch::Contains("page 1 slot 0 is at position 32, not after 95"));
  }
  SECTION("after tokens of its own, only past their positions and on a page boundary") {
    cache.append_encoded_pages(target, 0, 1, from_source(0));
    const auto again = test::thrown_error([&] { cache.append_encoded_pages(target, 0, 1, from_source(0)); });
    REQUIRE(again);
    CHECK_THAT(again->what(), Catch::Contains("slot 0 is at position 0, not after 31"));
    const std::vector<float> row(static_cast<std::size_t>(test::kPageFileShape.kv_heads) * 64, 0.5f);
    cache.append(target, 0, std::span<const float>(row), std::span<const float>(row), 40);
    const auto later = [&](index_t s, std::size_t p) { return held_page(source, seq, 0, s, p + 2); };
    const auto error = test::thrown_error([&] { cache.append_encoded_pages(target, 0, 1, later); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kUnsupported);
    CHECK_THAT(error->what(), Catch::Contains("holds 1 full-precision rows"));
  }
  SECTION("caches whose state a page does not carry") {
    KVCache<layout::GQA, quant::Q8_0, evict::StreamingLLM<>> evicting(test::kPageFileShape);
    const SeqId e = evicting.add_sequence();
    const auto error = test::thrown_error([&] { evicting.append_encoded_pages(e, 0, 3, from_source(0)); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kUnsupported);
  }
}

TEST_CASE("page files load into a cache with a full-precision tail or Quest's summaries", "[io][page_file]") {
  KVCache<layout::GQA, quant::Q8_0> source(test::kPageFileShape);
  const SeqId seq = test::fill_sequence(source);
  const std::vector<std::byte> bytes = io::write_page_file(source, seq);
  const std::vector<float> row(static_cast<std::size_t>(test::kPageFileShape.kv_heads) * 64, 0.25f);
  SECTION("the tail starts empty and takes the tokens decoded next, as the source's does") {
    CacheConfig config;
    config.tail_tokens = 64;
    KVCache<layout::GQA, quant::Q8_0> cache(test::kPageFileShape, config);
    const SeqId copy = io::load_page_file(cache, io::PageFileView::parse(bytes));
    for (index_t layer = 0; layer < test::kPageFileShape.layers; ++layer) {
      for (auto* c : {&source, &cache}) {
        const SeqId s = c == &source ? seq : copy;
        c->append(s, layer, std::span<const float>(row), std::span<const float>(row), 96);
      }
    }
    test::check_same_attention(source, seq, cache, copy);
  }
  SECTION("Quest selects the same pages as it would from the source's own prefill") {
    using Quest = KVCache<layout::GQA, quant::Q8_0, evict::KeepAll, select::Quest>;
    const select::Quest quest{.token_budget = 32, .dense_layers = 0, .min_pages = 1};  // 1 page of 3
    Quest original(test::kPageFileShape, {}, {}, {}, {}, quest);
    const SeqId filled = test::fill_sequence(original);
    Quest cache(test::kPageFileShape, {}, {}, {}, {}, quest);
    const SeqId copy = io::load_page_file(cache, io::PageFileView::parse(bytes));
    test::check_same_attention(original, filled, cache, copy);
  }
}
