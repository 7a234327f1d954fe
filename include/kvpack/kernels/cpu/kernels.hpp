#pragma once
/// \file kernels.hpp
/// \brief The CPU decode-attention kernels as functors templated on an xsimd arch.
///
/// The call operators are declared here and defined in kernels_impl.hpp, out of class, so the
/// dispatch library can compile each one per instruction set in its own translation unit and
/// other translation units see only `extern template` declarations (xsimd's documented pattern).

#include <type_traits>

#include "kvpack/kernels/kernel_args.hpp"

namespace kvpack::inline v0::quant {
template <int Bits, int Group, Plane kPlaneOf>
struct KiviTokenCodec;
template <int Bits>
struct KVQuantValueCodec;
}  // namespace kvpack::inline v0::quant

namespace kvpack::inline v0::kernels::cpu {

/// Whether AccumulateValues<ValueCodec> requests the value planes of the pages ahead of it
/// (PagePrefetcher with Plane::kValue). attend_stream then sets PageRun::planes_apart and the
/// key kernels request only the key planes: memory works through both passes, each requesting
/// what it will read, instead of idling while the values of pages fetched with the keys are
/// summed. KIVI's and KVQuant-2/4's kernels do it (measured faster); KVQuant-3's value pass
/// measured 3 % slower with it.
template <class ValueCodec>
inline constexpr bool kValueKernelPrefetches = false;
template <int Bits, int Group>
inline constexpr bool kValueKernelPrefetches<quant::KiviTokenCodec<Bits, Group, Plane::kValue>> = true;
template <int Bits>
inline constexpr bool kValueKernelPrefetches<quant::KVQuantValueCodec<Bits>> = Bits == 2 || Bits == 4;

/// scores = q · k for every slot of a run of pages, read from the key plane as stored.
template <class KeyCodec>
struct ScoreKeys {
  using args_type = ScoreArgs<typename KeyCodec::params_type>;
  template <class Arch>
  void operator()(Arch arch, const args_type& args) const noexcept;
};

/// acc += Σ w · v over every slot of a run of pages, read from the value plane as stored.
template <class ValueCodec>
struct AccumulateValues {
  using args_type = AccumulateArgs<typename ValueCodec::params_type>;
  template <class Arch>
  void operator()(Arch arch, const args_type& args) const noexcept;
};

/// The online-softmax step between scoring and accumulating.
struct SoftmaxUpdate {
  using args_type = SoftmaxArgs;
  template <class Arch>
  void operator()(Arch arch, const args_type& args) const noexcept;
};

/// Scores of full-precision rows (a stream's tail window).
struct ScoreRows {
  using args_type = RowScoreArgs;
  template <class Arch>
  void operator()(Arch arch, const args_type& args) const noexcept;
};

/// scores = q · RoPE(k, position) for keys stored before RoPE (CacheConfig::key_rope).
template <class KeyCodec>
struct ScoreRotatedKeys {
  using args_type = RotatedScoreArgs<typename KeyCodec::params_type>;
  template <class Arch>
  void operator()(Arch arch, const args_type& args) const noexcept;
};

/// Scores of full-precision pre-RoPE rows (the tail of a pre-RoPE stream).
struct ScoreRotatedRows {
  using args_type = RotatedRowScoreArgs;
  template <class Arch>
  void operator()(Arch arch, const args_type& args) const noexcept;
};

/// One plane of one page decoded to fp32, channel-major (layout::MLA scores its latent so).
template <class Codec>
struct DecodeChannelMajor {
  using args_type = DecodePlaneArgs<Codec>;
  template <class Arch>
  void operator()(Arch arch, const args_type& args) const noexcept;
};

/// fp16 or bfloat16 inputs widened to fp32 (the cache's append, prefill and query inputs).
template <class T>
struct WidenToFloat {
  using args_type = WidenArgs<T>;
  template <class Arch>
  void operator()(Arch arch, const args_type& args) const noexcept;
};

/// One page plane encoded from fp32 rows, byte for byte the codec's own `encode`: the write
/// path's kernels for quant::Float, Int8, Q8_0, Q4_0 and KIVI planes (has_plane_encoder_v). One
/// may decline a page (EncodeRowsArgs::declined), which the caller then encodes itself.
template <class Codec>
struct EncodePlane {
  using args_type = EncodeRowsArgs;
  template <class Arch>
  void operator()(Arch arch, const args_type& args) const noexcept;
};

}  // namespace kvpack::inline v0::kernels::cpu
