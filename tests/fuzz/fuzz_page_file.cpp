// libFuzzer target (clang -fsanitize=fuzzer): the page file reader (io/page_file_reader.hpp) on
// arbitrary bytes. Every input must either be rejected with a kvpack::Error (any other exception
// escapes and fails the run) or parse; a parsed file must be self-consistent and every view it
// hands out must lie inside the input: payloads, planes, slots and parameters, page by page.
// libFuzzer's malloc limit fails any allocation a size field could blow up.
// Random mutations almost never keep a CRC32C right, so each input is parsed twice: as it is, and
// with its checksums and length recomputed (test::reseal), which lets mutations of header fields, parameters
// and slots reach the checks behind the checksums.
// Built and run by cmake/run_sanitizers.sh over the seed corpus in tests/fuzz/corpus/page_file
// (valid files from the writer of several codecs and layouts, and a few broken ones).

#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz/fuzz_check.hpp"
#include "kvpack/io/page_file_reader.hpp"
#include "unit/io/page_file_surgery.hpp"

namespace {

bool inside(std::span<const std::byte> view, std::span<const std::byte> buffer) {
  return view.data() >= buffer.data() && view.data() + view.size() <= buffer.data() + buffer.size();
}

void check_file(std::span<const std::byte> buffer) {
  using namespace kvpack;
  const std::size_t size = buffer.size();
  try {
    const io::PageFileView file = io::PageFileView::parse(buffer);
    const io::PageFileHeader& h = file.header();
    FUZZ_CHECK(size % io::kPageFileAlignment == 0);
    FUZZ_CHECK(h.page_size >= 16 && h.page_size <= 256 && h.streams == h.shape.kv_heads);
    FUZZ_CHECK(h.page_counts.size() == static_cast<std::size_t>(h.cache_layers) * h.streams);
    FUZZ_CHECK(h.value_plane_offset + h.value_plane_bytes <= h.payload_bytes && h.key_plane_bytes <= h.value_plane_offset);
    FUZZ_CHECK(h.total_pages() * h.payload_bytes < size);
    FUZZ_CHECK(file.tokens().size() * sizeof(std::int32_t) < size);  // copied from TOKN, so no larger
    const std::int64_t limit = h.keys_before_rope ? h.rope_max_position : INT32_MAX;
    for (index_t layer = 0; layer < h.cache_layers; ++layer) {
      for (index_t stream = 0; stream < h.streams; ++stream) {
        FUZZ_CHECK(inside(file.key_params(layer, stream), buffer) && inside(file.value_params(layer, stream), buffer));
        for (std::uint32_t page = 0; page < file.page_count(layer, stream); ++page) {
          const std::span<const std::byte> payload = file.payload(layer, stream, page);
          FUZZ_CHECK(payload.size() == h.payload_bytes && inside(payload, buffer));
          FUZZ_CHECK(inside(file.key_plane(layer, stream, page), payload));
          FUZZ_CHECK(inside(file.value_plane(layer, stream, page), payload));
          // Payloads keep their 64-byte alignment relative to the start of the file.
          FUZZ_CHECK(static_cast<std::size_t>(payload.data() - buffer.data()) % io::kPageFileAlignment == 0);
          for (index_t slot = 0; slot < h.page_size; ++slot) {
            const std::int32_t position = file.position(layer, stream, page, slot);
            FUZZ_CHECK(!file.live(layer, stream, page, slot) || (position >= 0 && position <= limit));
          }
        }
      }
    }
    // Out-of-range requests are errors, not reads past the views.
    bool threw = false;
    try {
      (void)file.payload(h.cache_layers, 0, 0);
    } catch (const Error& e) {
      threw = e.code() == ErrorCode::kInvalidArgument;
    }
    FUZZ_CHECK(threw);
  } catch (const Error& e) {
    FUZZ_CHECK(e.code() == ErrorCode::kInvalidArgument || e.code() == ErrorCode::kUnsupported);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> buffer(reinterpret_cast<const std::byte*>(data), size);
  check_file(buffer);
  if (size >= kvpack::io::kPreambleBytes) {
    std::vector<std::byte> resealed(buffer.begin(), buffer.end());
    kvpack::test::store_u64(resealed, 16, resealed.size());  // the declared length too: inputs grow and shrink
    kvpack::test::reseal(resealed);
    check_file(resealed);
  }
  return 0;
}
