// The page file reader on bad input: truncated at every byte, every single-bit flip, wrong magic
// and version, oversized lengths, inconsistent headers, unknown codecs and layouts, bad codec
// parameters and slots. Each is rejected with its exact ErrorCode and a message naming the cause,
// and never crashes (the io module also runs under ASan + UBSan, and fuzz_page_file fuzzes it).

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvpack/io/page_file.hpp"
#include "kvpack/kvpack.hpp"
#include "unit/io/page_file_fixture.hpp"
#include "unit/io/page_file_surgery.hpp"
#include "unit/io/thrown_error.hpp"

namespace {

using namespace kvpack;

/// A small valid file (4.5 KiB): 1 layer, 1 KV stream of 3 FP8 pages of 16 tokens, with token ids.
std::vector<std::byte> small_file() {
  CacheConfig config;
  config.page_size = 16;
  KVCache<layout::GQA, quant::FP8<quant::E4M3FN>> cache(ModelShape{1, 2, 1, 32}, config);
  const SeqId seq = test::fill_sequence(cache);
  const std::vector<std::int32_t> tokens = test::token_ids(test::page_file_tokens(config));
  return io::write_page_file(cache, seq, {"small", tokens});
}

/// The error parsing `file` throws; the test fails if it parses.
Error parse_error(std::span<const std::byte> file) {
  const auto error = test::thrown_error([&] { (void)io::PageFileView::parse(file, "f"); });
  REQUIRE(error);
  return *error;
}

void check_rejected(std::span<const std::byte> file, ErrorCode code, const std::string& words) {
  const Error e = parse_error(file);
  INFO(e.what());
  CHECK(e.code() == code);
  CHECK_THAT(e.what(), Catch::Contains(words));
}

}  // namespace

TEST_CASE("the small file the bad-input tests start from is valid", "[io][page_file]") {
  const std::vector<std::byte> file = small_file();
  const io::PageFileView view = io::PageFileView::parse(file);
  CHECK(view.total_pages() == 3);
  CHECK(view.tokens().size() == 48);
  // Re-sealing or rebuilding an unchanged file changes nothing, so the edits below test one thing.
  std::vector<std::byte> resealed = file;
  test::reseal(resealed);
  CHECK(resealed == file);
  CHECK(test::with_header(file, [](io::PageFileHeader&) {}) == file);
}

TEST_CASE("a page file truncated at any byte is rejected", "[io][page_file]") {
  const std::vector<std::byte> file = small_file();
  const std::span<const std::byte> all(file);
  for (std::size_t cut = 0; cut < file.size(); ++cut) {
    INFO("cut at " << cut);
    const Error e = parse_error(all.first(cut));
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(e.what(), Catch::Contains(cut < 12 ? "not a kvpack page file" : "truncated"));
  }
  // Also when the preamble is re-sealed to declare the shorter length: then the section that
  // runs past the end is named, at each section boundary and inside each body.
  for (const test::SectionAt& s : test::sections_of(file)) {
    for (const std::size_t cut : {s.header, s.header + 10, s.body, s.body + s.length / 2, s.body + s.length - 1}) {
      if (cut >= file.size()) continue;
      std::vector<std::byte> shorter(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(cut));
      test::store_u64(shorter, 16, cut);
      test::reseal(shorter);
      INFO("cut at " << cut);
      const Error e = parse_error(shorter);
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      CHECK_THAT(e.what(), Catch::Contains("truncated") || Catch::Contains("left in the file") ||
                               Catch::Contains("padding"));
    }
  }
}

TEST_CASE("every single-bit flip of a page file is rejected", "[io][page_file]") {
  const std::vector<std::byte> file = small_file();
  for (std::size_t at = 0; at < file.size(); ++at) {
    for (const int bit : {0, 5}) {
      std::vector<std::byte> flipped = file;
      flipped[at] ^= static_cast<std::byte>(1 << bit);
      INFO("byte " << at << " bit " << bit);
      const Error e = parse_error(flipped);
      // The version field reads as a version this build does not know; anything else is corrupt.
      CHECK(e.code() == (at >= 8 && at < 12 ? ErrorCode::kUnsupported : ErrorCode::kInvalidArgument));
    }
  }
  // A flipped payload byte names the PAGE section's checksum.
  std::vector<std::byte> flipped = file;
  flipped[test::sections_of(file)[4].body + 100] ^= std::byte{0x10};
  check_rejected(flipped, ErrorCode::kInvalidArgument, "section PAGE fails its checksum");
}

TEST_CASE("magic, version and lengths are checked before they are used", "[io][page_file]") {
  const std::vector<std::byte> file = small_file();
  SECTION("wrong magic") {
    std::vector<std::byte> bad = file;
    bad[3] = std::byte{'X'};
    check_rejected(bad, ErrorCode::kInvalidArgument, "not a kvpack page file");
    check_rejected({}, ErrorCode::kInvalidArgument, "not a kvpack page file");
  }
  SECTION("an unknown version, even with nothing after it") {
    std::vector<std::byte> bad = file;
    test::store_u32(bad, 8, 2);
    test::reseal(bad);
    check_rejected(bad, ErrorCode::kUnsupported, "has page file version 2; this build reads version 1");
    check_rejected(std::span<const std::byte>(bad).first(12), ErrorCode::kUnsupported, "version 2");
    test::store_u32(bad, 8, 0);
    check_rejected(bad, ErrorCode::kUnsupported, "version 0");
  }
  SECTION("a file length of 2^62 or 2^64 - 1") {
    for (const std::uint64_t huge : {std::uint64_t{1} << 62, ~std::uint64_t{0}}) {
      std::vector<std::byte> bad = file;
      test::store_u64(bad, 16, huge);
      test::reseal(bad);
      check_rejected(bad, ErrorCode::kInvalidArgument, "is truncated: it holds");
    }
  }
  SECTION("a section length of 2^62 or 2^64 - 1, in every section") {
    for (const test::SectionAt& s : test::sections_of(file)) {
      for (const std::uint64_t huge : {std::uint64_t{1} << 62, ~std::uint64_t{0}}) {
        std::vector<std::byte> bad = file;
        test::store_u64(bad, s.header + 8, huge);
        test::reseal(bad);
        check_rejected(bad, ErrorCode::kInvalidArgument, "bytes, " );
        CHECK_THAT(parse_error(bad).what(), Catch::Contains("left in the file"));
      }
    }
  }
  SECTION("sections out of order, too many, trailing bytes") {
    std::vector<std::byte> bad = file;
    test::store_u32(bad, test::sections_of(file)[1].header, static_cast<std::uint32_t>(io::SectionTag::kPages));
    test::reseal(bad);
    check_rejected(bad, ErrorCode::kInvalidArgument, "section 1 is \"PAGE\", expected \"PARM\"");
    bad = file;
    test::store_u32(bad, 12, 6);
    test::reseal(bad);
    check_rejected(bad, ErrorCode::kInvalidArgument, "declares 6 sections");
    bad = file;
    bad.resize(bad.size() + 64);
    test::store_u64(bad, 16, bad.size());
    test::reseal(bad);
    check_rejected(bad, ErrorCode::kInvalidArgument, "64 bytes after its last section");
  }
  SECTION("reserved bytes") {
    std::vector<std::byte> bad = file;
    bad[40] = std::byte{1};
    check_rejected(bad, ErrorCode::kInvalidArgument, "reserved bytes [28, 64) are not zero");
  }
}

TEST_CASE("a header that does not describe its pages is rejected", "[io][page_file]") {
  const std::vector<std::byte> file = small_file();
  const auto rejected = [&](const std::function<void(io::PageFileHeader&)>& edit, ErrorCode code,
                            const std::string& words) { check_rejected(test::with_header(file, edit), code, words); };
  SECTION("codecs and layouts this build does not read") {
    rejected([](auto& h) { h.key_codec = "nuq5_key"; }, ErrorCode::kUnsupported,
             "key codec \"nuq5_key\" (group 0) is not one this build reads");
    rejected([](auto& h) { h.value_codec = "turbo_mse4_value"; }, ErrorCode::kUnsupported, "value codec");
    rejected([](auto& h) { h.key_codec = "fp8_e4m3fn_v2"; }, ErrorCode::kUnsupported, "fp8_e4m3fn_v2");
    rejected([](auto& h) { h.key_group = 32; }, ErrorCode::kUnsupported, "(group 32)");
    rejected([](auto& h) { h.layout = "yoco"; }, ErrorCode::kUnsupported, "layout \"yoco\"");
    // MLA keeps one latent stream per layer: a file of two KV heads cannot be one.
    rejected([](auto& h) { h.layout = "mla"; h.shape.kv_heads = 2; }, ErrorCode::kInvalidArgument,
             "layout mla keeps one latent stream per layer, but META.kv_heads = 2");
  }
  SECTION("shape and sizes") {
    rejected([](auto& h) { h.shape.layers = 0; }, ErrorCode::kInvalidArgument, "META.layers = 0");
    rejected([](auto& h) { h.shape.head_dim = 1 << 30; }, ErrorCode::kInvalidArgument, "META.head_dim");
    rejected([](auto& h) { h.shape.q_heads = 3; h.shape.kv_heads = 2; }, ErrorCode::kInvalidArgument,
             "not a multiple of kv_heads");
    rejected([](auto& h) { h.page_size = 40; }, ErrorCode::kInvalidArgument, "page_size = 40 is not a multiple of 16");
    // Slot sizes are checked in META; plane sizes once PARM gives the codec's options.
    rejected([](auto& h) { h.page_size = 32; }, ErrorCode::kInvalidArgument, "META.slot_bytes");
    rejected([](auto& h) { h.key_plane_bytes += 64; }, ErrorCode::kInvalidArgument, "META.key_plane_bytes");
    rejected([](auto& h) { h.cache_layers = 2; }, ErrorCode::kInvalidArgument, "META.cache_layers = 2");
    rejected([](auto& h) { h.payload_bytes += 64; }, ErrorCode::kInvalidArgument, "META.payload_bytes");
    rejected([](auto& h) { h.value_plane_offset = 0; }, ErrorCode::kInvalidArgument, "META.value_plane_offset");
    rejected([](auto& h) { h.slot_bytes = 8; }, ErrorCode::kInvalidArgument, "META.slot_bytes");
    rejected([](auto& h) { h.model_id = std::string(300, 'm'); }, ErrorCode::kInvalidArgument,
             "model_id is 300 bytes long, at most 256");
    rejected([](auto& h) { h.sequence_tokens = std::uint64_t{1} << 62; }, ErrorCode::kInvalidArgument,
             "META.sequence_tokens");
    rejected([](auto& h) { h.keys_before_rope = true; }, ErrorCode::kInvalidArgument, "not a valid RopeSpec");
  }
  SECTION("page counts that the sections do not hold, up to 2^32 - 1 pages") {
    rejected([](auto& h) { h.page_counts[0] = 4; }, ErrorCode::kInvalidArgument, "SLOT holds");
    rejected([](auto& h) { h.page_counts[0] = ~std::uint32_t{0}; }, ErrorCode::kInvalidArgument, "SLOT holds");
    rejected([](auto& h) { h.page_counts.push_back(1); }, ErrorCode::kInvalidArgument, "bytes of page counts");
  }
}

TEST_CASE("a geometry the codec cannot store is rejected with the codec's own error", "[io][page_file]") {
  CacheConfig config;
  config.page_size = 16;
  KVCache<layout::GQA, quant::Q8_0> cache(ModelShape{1, 2, 1, 32}, config);
  const std::vector<std::byte> file = io::write_page_file(cache, test::fill_sequence(cache));
  const std::vector<std::byte> bad = test::with_header(file, [](io::PageFileHeader& h) {
    h.shape.head_dim = h.key_dim = h.value_dim = 48;  // q8_0 blocks are 32 channels
  });
  const Error e = parse_error(bad);
  CHECK(e.code() == ErrorCode::kUnsupported);
  CHECK_THAT(e.what(), Catch::Contains("48"));
}

TEST_CASE("codec parameters, token ids and slots are checked", "[io][page_file]") {
  const std::vector<std::byte> file = small_file();
  const auto edit_section = [&](std::size_t index, std::size_t at, const auto& value) {
    return test::with_section(file, index, [&](std::vector<std::byte> body) {
      std::memcpy(body.data() + at, &value, sizeof(value));
      return body;
    });
  };
  constexpr std::size_t kParams = 1, kTokens = 2, kSlots = 3;
  SECTION("FP8 scales") {
    for (const float scale : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity()}) {
      check_rejected(edit_section(kParams, 16, scale), ErrorCode::kInvalidArgument, "FP8 scale");
      check_rejected(edit_section(kParams, 20, scale), ErrorCode::kInvalidArgument, "FP8 scale");
    }
  }
  SECTION("parameters of another kind or size") {
    check_rejected(edit_section(kParams, 0, std::uint32_t{0}), ErrorCode::kInvalidArgument, "PARM declares");
    check_rejected(edit_section(kParams, 12, std::uint32_t{1u << 30}), ErrorCode::kInvalidArgument, "PARM declares");
    check_rejected(test::with_section(file, kParams, [](std::vector<std::byte> b) { b.erase(b.end() - 4, b.end()); return b; }),
                   ErrorCode::kInvalidArgument, "PARM holds");
  }
  SECTION("token counts") {
    check_rejected(edit_section(kTokens, 0, std::uint64_t{1} << 62), ErrorCode::kInvalidArgument, "TOKN declares");
    check_rejected(edit_section(kTokens, 0, std::uint64_t{47}), ErrorCode::kInvalidArgument, "TOKN declares 47");
  }
  SECTION("slot positions and live masks") {
    // Page 1, slot 3 (live): a negative position.
    const std::size_t page1 = 16 * 4 + 8;
    check_rejected(edit_section(kSlots, page1 + 3 * 4, std::int32_t{-5}), ErrorCode::kInvalidArgument,
                   "page 1 slot 3 has position -5");
    // page_size 16: mask bits 16..63 must be clear.
    check_rejected(edit_section(kSlots, page1 + 16 * 4, ~std::uint64_t{0}), ErrorCode::kInvalidArgument,
                   "marks slots beyond page_size");
    // A dead slot may hold any position.
    std::vector<std::byte> dead = edit_section(kSlots, page1 + 16 * 4, std::uint64_t{0xFFF7});
    dead = test::with_section(dead, kSlots, [&](std::vector<std::byte> body) {
      const std::int32_t bad = -5;
      std::memcpy(body.data() + page1 + 3 * 4, &bad, 4);
      return body;
    });
    const io::PageFileView view = io::PageFileView::parse(dead);
    CHECK_FALSE(view.live(0, 0, 1, 3));
    CHECK(view.live(0, 0, 1, 4));
  }
}

TEST_CASE("pre-RoPE keys' positions stay within the RoPE tables", "[io][page_file]") {
  CacheConfig config;
  config.page_size = 16;
  config.key_rope = RopeSpec{10000.0, RopePairing::kAdjacent, 100};
  KVCache<layout::GQA, quant::Float<half>> cache(ModelShape{1, 1, 1, 16}, config);
  const std::vector<std::byte> file = io::write_page_file(cache, test::fill_sequence(cache));
  const auto with_position = [&](std::int32_t position) {
    return test::with_section(file, 3, [&](std::vector<std::byte> body) {
      std::memcpy(body.data() + 5 * 4, &position, 4);  // page 0, slot 5
      return body;
    });
  };
  const std::vector<std::byte> at_limit = with_position(100);
  CHECK(io::PageFileView::parse(at_limit).position(0, 0, 0, 5) == 100);
  check_rejected(with_position(101), ErrorCode::kInvalidArgument, "page 0 slot 5 has position 101, outside [0, 100]");
}

TEST_CASE("views of a parsed file are bounds-checked", "[io][page_file]") {
  const std::vector<std::byte> file = small_file();
  const io::PageFileView view = io::PageFileView::parse(file);
  for (const auto& call : std::vector<std::function<void()>>{
           [&] { (void)view.payload(1, 0, 0); }, [&] { (void)view.payload(0, 1, 0); },
           [&] { (void)view.payload(0, 0, 3); }, [&] { (void)view.position(0, 0, 0, 16); },
           [&] { (void)view.live(0, 0, 0, -1); }, [&] { (void)view.key_params(-1, 0); }}) {
    const auto error = test::thrown_error(call);
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kInvalidArgument);
  }
}

TEST_CASE("PageFile names the path it cannot open", "[io][page_file]") {
  const auto missing = test::thrown_error([] { io::PageFile file("/nonexistent/kvpack.pages"); });
  REQUIRE(missing);
  CHECK(missing->code() == ErrorCode::kInvalidArgument);
  CHECK_THAT(missing->what(), Catch::Contains("'/nonexistent/kvpack.pages' cannot be opened"));
  const auto empty = test::thrown_error([] { io::PageFile file("/dev/null"); });
  REQUIRE(empty);
  CHECK(empty->code() == ErrorCode::kInvalidArgument);
}
