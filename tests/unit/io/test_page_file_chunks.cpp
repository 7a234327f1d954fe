// Page files of a chunk of a sequence (PageFileOptions::first_page / page_count), and
// append_page_file: chunks written one by one and appended one after another give back the
// whole sequence byte for byte; a chunk that cannot follow leaves the sequence as it was.
// Also the payload padding chunks first exposed: zero in files, ignored by the loader.

#include <catch2/catch.hpp>

#include <algorithm>
#include <vector>

#include "kvpack/io/page_file.hpp"
#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"
#include "unit/io/page_file_fixture.hpp"
#include "unit/io/page_file_surgery.hpp"
#include "unit/io/thrown_error.hpp"

using namespace kvpack;
using Cache = KVCache<layout::GQA, quant::Q4_0>;

namespace {

/// Page `page` of every stream of `seq`, alone.
std::vector<std::byte> chunk_file(const Cache& cache, SeqId seq, std::size_t page) {
  return io::write_page_file(cache, seq, io::PageFileOptions{"m", {}, page, 1});
}

}  // namespace

TEST_CASE("chunks written one page at a time append back into the whole sequence", "[io][page_file]") {
  Cache source(test::kPageFileShape);
  const SeqId seq = test::fill_sequence(source);  // 3 pages per stream
  const std::vector<std::byte> whole = io::write_page_file(source, seq, {"m", {}});
  std::vector<std::vector<std::byte>> chunks;
  for (std::size_t p = 0; p < 3; ++p) chunks.push_back(chunk_file(source, seq, p));
  const io::PageFileView first = io::PageFileView::parse(chunks[0]);
  CHECK(first.header().sequence_tokens == 32);
  CHECK(first.page_count(0, 1) == 1);
  CHECK(io::PageFileView::parse(chunks[2]).position(0, 0, 0, 0) == 64);

  Cache target(test::kPageFileShape);
  SeqId loaded = io::load_page_file(target, first);
  for (std::size_t p = 1; p < 3; ++p) {
    const SeqId longer = io::append_page_file(target, loaded, io::PageFileView::parse(chunks[p]));
    target.release(loaded);
    loaded = longer;
  }
  CHECK(io::write_page_file(target, loaded, {"m", {}}) == whole);
  CHECK(target.sequence_count() == 1);
  CHECK(target.memory().pages_in_use == source.memory().pages_in_use);

  SECTION("a chunk whose positions do not come after the sequence's leaves it as it was") {
    const std::size_t pages = target.memory().pages_in_use;
    const auto error =
        test::thrown_error([&] { (void)io::append_page_file(target, loaded, io::PageFileView::parse(chunks[0])); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kInvalidArgument);
    CHECK(target.sequence_count() == 1);
    CHECK(target.memory().pages_in_use == pages);
    CHECK(io::write_page_file(target, loaded, {"m", {}}) == whole);
  }
  SECTION("pages outside the sequence are refused") {
    const auto error = test::thrown_error([&] { (void)chunk_file(source, seq, 3); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(error->what(), Catch::Contains("pages [3, 4) asked of layer 0 stream 0, which holds 3"));
  }
}

// q8_0 at head_dim 32 and pages of 16: a plane is 544 bytes, so each payload has padding after
// the key plane (to the 64-byte-aligned value plane) and after the value plane. The codecs never
// write it, so in a recycled slab it holds old bytes; it must not reach files or fail loads.
TEST_CASE("padding around the planes is zero in files and ignored by the loader", "[io][page_file]") {
  using Q8 = KVCache<layout::GQA, quant::Q8_0>;
  CacheConfig config;
  config.page_size = 16;
  const ModelShape shape{1, 4, 2, 32};
  Q8 source(shape, config);
  const SeqId seq = source.add_sequence();
  const std::vector<float> keys = test::random_rows(64 * 2, 32, 1), values = test::random_rows(64 * 2, 32, 2);
  source.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values));
  const std::vector<std::byte> clean = io::write_page_file(source, seq, {"m", {}});
  const io::PageFileHeader h = io::PageFileView::parse(clean).header();
  REQUIRE(h.key_plane_bytes < h.value_plane_offset);
  REQUIRE(h.value_plane_offset + h.value_plane_bytes < h.payload_bytes);
  const auto poison = [&](std::byte* payload) {
    std::fill(payload + h.key_plane_bytes, payload + h.value_plane_offset, std::byte{0xAB});
    std::fill(payload + h.value_plane_offset + h.value_plane_bytes, payload + h.payload_bytes, std::byte{0xCD});
  };
  // What a recycled slab would hold (the pool's bytes are not the test's to write otherwise).
  for (index_t s = 0; s < 2; ++s) {
    for (const PageId id : source.pages(seq, 0, s)) poison(const_cast<std::byte*>(source.pool().payload(id)));
  }
  CHECK(io::write_page_file(source, seq, {"m", {}}) == clean);

  std::vector<std::byte> poisoned = clean;
  const io::PageFileView view = io::PageFileView::parse(clean);
  for (index_t s = 0; s < 2; ++s) {
    for (std::uint32_t p = 0; p < view.page_count(0, s); ++p) {
      poison(poisoned.data() + (view.payload(0, s, p).data() - clean.data()));
    }
  }
  test::reseal(poisoned);
  Q8 target(shape, config);
  const SeqId loaded = io::load_page_file(target, io::PageFileView::parse(poisoned));
  CHECK(io::write_page_file(target, loaded, {"m", {}}) == clean);
}
