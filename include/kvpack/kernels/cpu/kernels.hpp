#pragma once
/// \file kernels.hpp
/// \brief The CPU decode-attention kernels as functors templated on an xsimd arch.
///
/// The call operators are declared here and defined in kernels_impl.hpp, out of class, so the
/// dispatch library can compile each one per instruction set in its own translation unit and
/// other translation units see only `extern template` declarations (xsimd's documented pattern).

#include <type_traits>

#include "kvpack/kernels/kernel_args.hpp"

namespace kvpack::inline v0::kernels::cpu {

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

/// One plane of a quant::Float<T> page encoded from fp32 rows: FloatCodec::encode's bytes.
template <class Codec>
struct EncodeFloatPlane {
  using args_type = EncodeRowsArgs;
  template <class Arch>
  void operator()(Arch arch, const args_type& args) const noexcept;
};

/// One plane of a quant::Int8 or quant::Q8_0 page encoded from fp32 rows: the codec's own bytes.
template <class Codec>
struct EncodeInt8Plane {
  using args_type = EncodeRowsArgs;
  template <class Arch>
  void operator()(Arch arch, const args_type& args) const noexcept;
};

/// One plane of a quant::Q4_0 page encoded from fp32 rows: the codec's own bytes.
template <class Codec>
struct EncodeQ4_0Plane {
  using args_type = EncodeRowsArgs;
  template <class Arch>
  void operator()(Arch arch, const args_type& args) const noexcept;
};

/// One plane of a quant::KIVI page encoded from fp32 rows: the codec's own bytes.
template <class Codec>
struct EncodeKiviPlane {
  using args_type = EncodeRowsArgs;
  template <class Arch>
  void operator()(Arch arch, const args_type& args) const noexcept;
};

}  // namespace kvpack::inline v0::kernels::cpu
