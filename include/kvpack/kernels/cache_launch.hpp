#pragma once
/// \file cache_launch.hpp
/// \brief One layer of a KVCache sequence as the arrays of a kernels::attend_paged launch over
///        the cache's own pages and full-precision rows, taken through its public accessors:
///        run it as it is (host memory, the CPU kernels), or copy the arrays and page bytes to
///        device memory and run it there.

#include <algorithm>
#include <span>
#include <type_traits>
#include <vector>

#include "kvpack/cache.hpp"
#include "kvpack/evict/keep_all.hpp"
#include "kvpack/kernels/attend_paged.hpp"

namespace kvpack::inline v0::kernels {

/// The launch for every KV stream of (seq, layer): `args()` points into this object and into the
/// cache, so it is valid while both are and the sequence is not written to, forked or released.
/// The caller sets args().queries ([streams][group][head_dim], times the softmax scale, as
/// KVCache::attend scales them) and args().out, then calls attend() or copies it all elsewhere.
/// Every page is read, whatever the cache's selector. Only for caches whose pages hold every
/// token and whose keys are stored after RoPE (the launch carries neither live masks nor
/// positions): an evicting or latent cache does not compile, keys stored before RoPE get
/// kUnsupported.
template <class Cache>
class CacheLayerLaunch {
  using KeyCodec = typename Cache::quantizer_type::key_codec;
  using ValueCodec = typename Cache::quantizer_type::value_codec;
  static_assert(std::is_same_v<typename Cache::evictor_type, evict::KeepAll>,
                "CacheLayerLaunch: an evicting cache's pages have dead slots, which a raw launch cannot mark");
  static_assert(!layout::scores_latent<typename Cache::layout_type>,
                "CacheLayerLaunch: layout::MLA's latent stream is not a K/V page pair");
  static_assert(PagedAttendable<KeyCodec, ValueCodec> && kHostParams<KeyCodec, ValueCodec>,
                "CacheLayerLaunch: the codecs' parameters must be what the kernels take (not KVQuant's "
                "tables) and the device must decode them (not TurboQuant or QJL)");

 public:
  CacheLayerLaunch(const Cache& cache, SeqId seq, index_t layer) {
    KVPACK_CHECK(!cache.config().key_rope, kUnsupported,
                 "CacheLayerLaunch: keys stored before RoPE need their positions, which a raw launch does not carry");
    const index_t streams = cache.streams_per_layer();
    for (index_t s = 0; s < streams; ++s) {
      const std::span<const PageId> table = cache.pages(seq, layer, s);
      for (PageId id : table) pages_.push_back(cache.pool().payload(id));
      first_page_.push_back(static_cast<index_t>(pages_.size()));
      max_pages_ = std::max(max_pages_, static_cast<index_t>(table.size()));
      const auto [key, value] = cache.codec_params(layer, s);
      key_params_.push_back(key);
      value_params_.push_back(value);
    }
    const auto rows = cache.full_precision_rows(seq, layer);
    tail_count_.assign(static_cast<std::size_t>(streams), rows.count);
    args_.pages = pages_.data();
    args_.first_page = first_page_.data();
    args_.key_params = key_params_.data();
    args_.value_params = value_params_.data();
    if (rows.count > 0) {
      args_.tail_keys = rows.keys;
      args_.tail_values = rows.values;
      args_.tail_count = tail_count_.data();
      args_.tail_stride = rows.stride;
    }
    args_.streams = streams;
    args_.group = cache.shape().group_size();
    args_.page_size = cache.config().page_size;
    args_.head_dim = cache.shape().head_dim;
    args_.value_offset = cache.value_plane_offset();
    args_.payload_bytes = cache.page_format_info().payload_bytes;
  }
  // args() points into the vectors: a copy would point into the original's (a move keeps them).
  CacheLayerLaunch(const CacheLayerLaunch&) = delete;
  CacheLayerLaunch& operator=(const CacheLayerLaunch&) = delete;
  CacheLayerLaunch(CacheLayerLaunch&&) noexcept = default;
  CacheLayerLaunch& operator=(CacheLayerLaunch&&) noexcept = default;

  [[nodiscard]] PagedArgs<KeyCodec, ValueCodec>& args() noexcept { return args_; }
  /// The most pages any stream holds: attend_paged's `max_pages`.
  [[nodiscard]] index_t max_pages() const noexcept { return max_pages_; }
  /// attend_paged over args() (set queries and out first).
  void attend(PagedWorkspace& workspace, void* stream = nullptr) const {
    attend_paged<KeyCodec, ValueCodec>(args_, max_pages_, workspace, stream);
  }

 private:
  std::vector<const std::byte*> pages_;
  std::vector<index_t> first_page_{0};
  std::vector<typename KeyCodec::params_type> key_params_;
  std::vector<typename ValueCodec::params_type> value_params_;
  std::vector<index_t> tail_count_;
  index_t max_pages_ = 0;
  PagedArgs<KeyCodec, ValueCodec> args_;
};

}  // namespace kvpack::inline v0::kernels
