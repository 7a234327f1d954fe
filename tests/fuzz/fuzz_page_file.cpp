// libFuzzer target (clang -fsanitize=fuzzer): the page file reader (io/page_file_reader.hpp) on
// arbitrary bytes. Every input must either be rejected with a kvpack::Error (any other exception
// escapes and fails the run) or parse; a parsed file must be self-consistent and every view it
// hands out must lie inside the input: payloads, planes, slots and parameters, page by page.
// libFuzzer's malloc limit fails any allocation a size field could blow up.
// Random mutations almost never keep a CRC32C right, so each input is parsed twice: as it is, and
// with its checksums and length recomputed (test::reseal), which lets mutations of header fields, parameters
// and slots reach the checks behind the checksums.
// A file that parses and holds f16, q4_0, KIVI-2, KVQuant-3 or TurboQuant-4 pages of a small shape
// is also loaded into a fresh cache of its type (io::load_page_file) at every PageCheck, its
// quantizer rebuilt from the file (io::quantizer_from_file: KVQuant's tables, TurboQuant's seeds):
// the load either throws a kvpack::Error and leaves no page allocated, or succeeds with every page
// equal to the file's.
// A sequence loaded at kFinite (its pages decode to finite values, canonical or not) is attended
// in every layer: the output must be finite.
// Built and run by cmake/run_sanitizers.sh over the seed corpus in tests/fuzz/corpus/page_file
// (valid files from the writer of several codecs and layouts, and a few broken ones).
// The codecs with tables put hostile values within reach: KVQuant codebooks, ranges and outlier
// sections, TurboQuant rotations and seeds.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "fuzz/fuzz_check.hpp"
#include "kvpack/io/page_file_loader.hpp"
#include "kvpack/io/page_file_quantizer.hpp"
#include "kvpack/io/page_file_reader.hpp"
#include "kvpack/kvpack.hpp"
#include "unit/io/page_file_surgery.hpp"

namespace {

bool inside(std::span<const std::byte> view, std::span<const std::byte> buffer) {
  return view.data() >= buffer.data() && view.data() + view.size() <= buffer.data() + buffer.size();
}

/// Loads `file` into a fresh `Cache` built from its header; see the file comment.
template <class Cache>
void check_load(const kvpack::io::PageFileView& file, kvpack::PageCheck check) {
  using namespace kvpack;
  const io::PageFileHeader& h = file.header();
  try {
    CacheConfig config;
    config.page_size = h.page_size;
    if (h.keys_before_rope) {
      config.key_rope = RopeSpec{h.rope_theta, static_cast<RopePairing>(h.rope_pairing), h.rope_max_position};
    }
    Cache cache(h.shape, config, io::quantizer_from_file<typename Cache::quantizer_type>(file));
    try {
      const SeqId seq = io::load_page_file(cache, file, check);
      const typename Cache::layout_type layout{};
      for (index_t c = 0; c < h.cache_layers; ++c) {
        for (index_t s = 0; s < h.streams; ++s) {
          const std::span<const PageId> ids = cache.pages(seq, layout::writer_of(layout, h.shape, c), s);
          FUZZ_CHECK(ids.size() == file.page_count(c, s));
          for (std::uint32_t p = 0; p < ids.size(); ++p) {
            // Both planes; the padding around them is not page data (the loader ignores it).
            const std::byte* held = cache.pool().payload(ids[p]);
            const std::byte* stored = file.payload(c, s, p).data();
            FUZZ_CHECK(std::memcmp(held, stored, h.key_plane_bytes) == 0);
            FUZZ_CHECK(std::memcmp(held + h.value_plane_offset, stored + h.value_plane_offset, h.value_plane_bytes) == 0);
          }
        }
        if (check == PageCheck::kFinite && file.page_count(c, 0) > 0) {
          const std::size_t width = static_cast<std::size_t>(h.shape.q_heads) * h.shape.head_dim;
          std::vector<float> query(width), out(width);
          for (std::size_t i = 0; i < width; ++i) query[i] = static_cast<float>(i % 7) - 3.0f;
          cache.attend(seq, layout::writer_of(layout, h.shape, c), std::span<const float>(query), std::span<float>(out),
                       0.125f);
          for (float x : out) FUZZ_CHECK(std::isfinite(x));
        }
      }
    } catch (const Error&) {
      FUZZ_CHECK(cache.memory().pages_in_use == 0);
      throw;
    }
  } catch (const Error& e) {
    FUZZ_CHECK(e.code() == ErrorCode::kInvalidArgument || e.code() == ErrorCode::kUnsupported ||
               e.code() == ErrorCode::kInvalidConfig || e.code() == ErrorCode::kOutOfRange);
  }
}

/// The seed corpus's codecs, at shapes small enough to load on every run.
void try_load(const kvpack::io::PageFileView& file, kvpack::PageCheck check) {
  using namespace kvpack;
  const io::PageFileHeader& h = file.header();
  const bool small = h.shape.layers <= 4 && h.shape.q_heads <= 16 && h.shape.kv_heads <= 4 && h.shape.head_dim <= 128 &&
                     file.total_pages() <= 256 && (!h.keys_before_rope || h.rope_max_position <= (1 << 16));
  if (!small) return;
  if (h.quantizer == quant::Float<half>::name() && h.layout == layout::GQA::kName) {
    check_load<KVCache<layout::GQA, quant::Float<half>>>(file, check);
  } else if (h.quantizer == quant::Q4_0::name() && h.layout == layout::CrossLayer<layout::GQA, 2>::kName) {
    check_load<KVCache<layout::CrossLayer<layout::GQA, 2>, quant::Q4_0>>(file, check);
  } else if (h.quantizer == quant::KIVI<2>::name() && h.layout == layout::GQA::kName) {
    check_load<KVCache<layout::GQA, quant::KIVI<2>>>(file, check);
  } else if (h.quantizer == quant::KVQuant<3>::name() && h.layout == layout::GQA::kName) {
    check_load<KVCache<layout::GQA, quant::KVQuant<3>>>(file, check);
  } else if (h.quantizer == quant::TurboQuant<4>::name() && h.layout == layout::GQA::kName) {
    check_load<KVCache<layout::GQA, quant::TurboQuant<4>>>(file, check);
  }
}

/// try_load at every PageCheck.
void try_load(const kvpack::io::PageFileView& file) {
  for (const kvpack::PageCheck check : {kvpack::PageCheck::kReencode, kvpack::PageCheck::kFinite,
                                        kvpack::PageCheck::kStructure}) {
    try_load(file, check);
  }
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
    try_load(file);
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
