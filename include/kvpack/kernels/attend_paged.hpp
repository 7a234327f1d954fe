#pragma once
/// \file attend_paged.hpp
/// \brief Decode attention over an engine's own page tables (paged_attention_args.hpp), on the
///        backend whose memory holds the buffers: the CPU kernels (attend_stream.hpp) for host
///        memory, the CUDA backend for device memory (dispatch.hpp, through kvpack::cuda).

#include <array>
#include <cstdint>
#include <string_view>
#include <type_traits>
#include <utility>

#include "kvpack/dispatch.hpp"
#include "kvpack/kernels/attend_stream.hpp"
#include "kvpack/kernels/cuda/element_decode.hpp"
#include "kvpack/kernels/paged_attention_args.hpp"

namespace kvpack::inline v0::kernels {

/// The launch arguments for a codec pair: the parameter types its device kernels take, which are
/// the codecs' own but for KVQuant's and TurboQuant's (element_decode.hpp's device_params_t).
template <class KeyCodec, class ValueCodec>
using PagedArgs = PagedAttentionArgs<cuda::device_params_t<KeyCodec>, cuda::device_params_t<ValueCodec>>;

/// The codec pairs raw launches take: every codec but TurboQuant-Prod's and QJL's, whose sketch
/// the device kernels do not apply.
template <class KeyCodec, class ValueCodec>
concept PagedAttendable = cuda::DeviceDecodable<KeyCodec> && cuda::DeviceDecodable<ValueCodec>;

/// Whether a codec pair's launches carry the codecs' own parameters, which the CPU kernels take
/// (all but KVQuant's and TurboQuant's, whose device forms hold copies of their tables).
template <class KeyCodec, class ValueCodec>
inline constexpr bool kHostParams =
    std::is_same_v<cuda::device_params_t<KeyCodec>, typename KeyCodec::params_type> &&
    std::is_same_v<cuda::device_params_t<ValueCodec>, typename ValueCodec::params_type>;

/// Scratch reused across attend_paged calls on either backend.
struct PagedWorkspace {
  Workspace host;
  dispatch::DeviceScratch device;
};

namespace paged_detail {

/// The launch's arrays, named for the error messages.
template <class Args>
auto pointer_fields(const Args& a) {
  return std::to_array<std::pair<const char*, const void*>>({{"pages", a.pages},
                                                             {"first_page", a.first_page},
                                                             {"key_params", a.key_params},
                                                             {"value_params", a.value_params},
                                                             {"tail_keys", a.tail_keys},
                                                             {"tail_values", a.tail_values},
                                                             {"tail_count", a.tail_count},
                                                             {"queries", a.queries},
                                                             {"out", a.out}});
}

/// The checks that need no memory behind the pointers: shape, codec geometry and plane placement
/// (for codecs whose default instance is every instance: not KVQuant's, built from tables),
/// every array present, and all of them on the backend that holds `out`, which is returned.
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
dispatch::Backend check_launch(const PagedArgs<KeyCodec, ValueCodec>& a, index_t max_pages) {
  KVPACK_CHECK(
      a.streams > 0 && a.group > 0 && a.head_dim > 0 && a.page_size > 0 && a.tail_stride >= 0 && max_pages >= 0,
      kInvalidArgument,
      ::kvpack::detail::message("attend_paged: streams, group, head_dim and page_size must be positive and "
                                "tail_stride, max_pages non-negative; got streams ",
                                a.streams, ", group ", a.group, ", head_dim ", a.head_dim, ", page_size ", a.page_size,
                                ", tail_stride ", a.tail_stride, ", max_pages ", max_pages));
  const quant::PageGeometry g{a.page_size, a.head_dim};
  if constexpr (kHostParams<KeyCodec, ValueCodec>) {
    KeyCodec{}.validate(g);
    ValueCodec{}.validate(g);
    const std::size_t key_bytes = KeyCodec{}.plane_bytes(g), value_bytes = ValueCodec{}.plane_bytes(g);
    KVPACK_CHECK(a.value_offset >= key_bytes, kInvalidArgument,
                 ::kvpack::detail::message("attend_paged: value_offset ", a.value_offset, " overlaps the K plane (",
                                           key_bytes, " bytes)"));
    KVPACK_CHECK(a.value_offset <= a.payload_bytes && value_bytes <= a.payload_bytes - a.value_offset,  // no wrap
                 kInvalidArgument,
                 ::kvpack::detail::message("attend_paged: the V plane (", value_bytes, " bytes at ", a.value_offset,
                                           ") runs past the payload (", a.payload_bytes, " bytes)"));
  }
  KVPACK_CHECK(
      a.payload_bytes % 64 == 0, kInvalidArgument,
      ::kvpack::detail::message("attend_paged: payload_bytes must be a multiple of 64, got ", a.payload_bytes));
  const dispatch::Backend backend = dispatch::backend_of(a.out);
  // The CPU kernels step through a page 8 or 16 tokens at a time (a cache's pages hold a
  // multiple of 16, CacheConfig): other sizes would read and write past a page's slots.
  KVPACK_CHECK(backend != dispatch::Backend::kCpu || a.page_size % 16 == 0, kInvalidArgument,
               ::kvpack::detail::message("attend_paged: pages in host memory must hold a multiple of 16 tokens, as a "
                                         "cache's do; got page_size ",
                                         a.page_size));
  for (const auto& [name, address] : pointer_fields(a)) {
    // Tail arrays are optional without tail rows; pages without pages (over host memory, where
    // the page ranges are read, a null `pages` with pages to read is rejected below).
    const bool optional = (std::string_view(name).starts_with("tail_") && a.tail_stride == 0) ||
                          std::string_view(name) == "pages";
    KVPACK_CHECK(address != nullptr || optional, kInvalidArgument,
                 ::kvpack::detail::message("attend_paged: ", name, " is null"));
    KVPACK_CHECK(address == nullptr || dispatch::backend_of(address) == backend, kInvalidArgument,
                 ::kvpack::detail::message("attend_paged: ", name, " is in ",
                                           backend == dispatch::Backend::kCuda ? "host" : "device",
                                           " memory, out in the other: a launch reads one backend's memory"));
  }
  return backend;
}

/// The per-stream checks, which read the arrays (host memory here).
template <class Args>
void check_streams_on_host(const Args& a, index_t max_pages) {
  for (index_t s = 0; s < a.streams; ++s) {
    // In 64 bits: hostile ranges must not overflow the checks meant to reject them.
    const std::int64_t pages = std::int64_t{a.first_page[s + 1]} - a.first_page[s];
    const std::int64_t tail = a.tail_stride == 0 ? 0 : a.tail_count[s];
    KVPACK_CHECK(a.first_page[s] >= 0 && pages >= 0 && pages <= max_pages && tail >= 0 && tail <= a.tail_stride &&
                     pages + tail > 0,
                 kInvalidArgument,
                 ::kvpack::detail::message("attend_paged: stream ", s, " has pages [", a.first_page[s], ", ",
                                           a.first_page[s + 1], ") (max_pages ", max_pages, ") and ", tail,
                                           " tail rows (tail_stride ", a.tail_stride,
                                           "); each stream needs a token, first_page must not decrease"));
    KVPACK_CHECK(pages == 0 || a.pages != nullptr, kInvalidArgument,
                 ::kvpack::detail::message("attend_paged: pages is null, but stream ", s, " has ", pages, " pages"));
    for (index_t i = a.first_page[s]; i < a.first_page[s + 1]; ++i) {
      KVPACK_CHECK(a.pages[i] != nullptr && reinterpret_cast<std::uintptr_t>(a.pages[i]) % 64 == 0, kInvalidArgument,
                   ::kvpack::detail::message("attend_paged: page ", i, " is null or not 64-byte aligned"));
    }
  }
}

}  // namespace paged_detail

/// out = softmax(q·Kᵀ) V for every stream and query head of `args` (queries carry the softmax
/// scale), where the buffers live: `args.out` picks the backend, and every other array must be
/// in the same memory (kInvalidArgument names the one that is not). `max_pages` is the most
/// pages any stream holds.
///
/// Host memory: the CPU kernels, synchronously, after checking every stream's page range, tail
/// count and page addresses (payloads 64-byte aligned, as the cache's pool lays them out).
/// Device memory: the CUDA backend, asynchronously on `stream` (a cudaStream_t; synchronise it
/// before reading `out`); the device arrays are not read on the host, so only the shape and
/// codec checks run. kUnsupported where that backend cannot take the launch: KVQuant's or
/// TurboQuant's device parameters on the CPU (attend through a KVCache there), a program
/// without kvpack::cuda, or a codec pair kvpack::cuda does not precompile.
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
  requires PagedAttendable<KeyCodec, ValueCodec>
void attend_paged(const PagedArgs<KeyCodec, ValueCodec>& args, index_t max_pages, PagedWorkspace& workspace,
                  void* stream = nullptr) {
  const dispatch::Backend backend = paged_detail::check_launch<KeyCodec, ValueCodec>(args, max_pages);
  if (backend == dispatch::Backend::kCuda) {
    dispatch::attend_paged_on_cuda<KeyCodec, ValueCodec>(args, max_pages, workspace.device, stream);
    return;
  }
  if constexpr (!kHostParams<KeyCodec, ValueCodec>) {
    throw Error(ErrorCode::kUnsupported,
                ::kvpack::detail::message("attend_paged: ", KeyCodec::kName, " / ", ValueCodec::kName,
                                          " launches carry device parameters; on the CPU, attend through a KVCache"));
  } else {
    paged_detail::check_streams_on_host(args, max_pages);
    const auto kernel_set = KernelSet<KeyCodec, ValueCodec>::selected();
    const std::size_t head_floats = static_cast<std::size_t>(args.group) * args.head_dim;
    for (index_t s = 0; s < args.streams; ++s) {
      PageRun run;
      run.pages = args.pages + args.first_page[s];
      run.count = args.first_page[s + 1] - args.first_page[s];
      run.page_size = args.page_size;
      run.head_dim = args.head_dim;
      run.value_offset = args.value_offset;
      run.payload_bytes = args.payload_bytes;
      const std::size_t tail_first = static_cast<std::size_t>(s) * args.tail_stride * args.head_dim;
      const TailView tail{args.tail_stride == 0 ? nullptr : args.tail_keys + tail_first,
                          args.tail_stride == 0 ? nullptr : args.tail_values + tail_first,
                          args.tail_stride == 0 ? 0 : args.tail_count[s]};
      workspace.host.prepare(args.group, args.head_dim, args.page_size, tail.count);
      attend_stream<KeyCodec, ValueCodec>(run, args.key_params[s], args.value_params[s], tail,
                                          args.queries + s * head_floats, args.group, args.out + s * head_floats,
                                          workspace.host, kernel_set);
    }
  }
}

}  // namespace kvpack::inline v0::kernels
