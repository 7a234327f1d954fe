#pragma once
/// \file precompiled.hpp
/// \brief The kernels the kvpack_cpu_dispatch library compiles once per instruction set.
///
/// Every shipped codec is listed (KIVI at both widths and all three group sizes, 32, 64 and 128),
/// the pre-RoPE key
/// scorers of every element format and KVQuant, layout::MLA's page decoders for the usual latent
/// and RoPE formats, and the write path's conversions and encoders (convert.hpp, encode_*.hpp).
/// A kernel not listed here (a user's own codec) still works: it is compiled inline for the
/// including file's own target (`default_arch`).

#include <type_traits>

#include "kvpack/kernels/cpu/kernels.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/fp8.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/kivi.hpp"
#include "kvpack/quant/kvquant.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"
#include "kvpack/quant/turboquant.hpp"

namespace kvpack::inline v0::kernels::cpu::precompiled {

// Aliases without commas, so the lists below can be macro arguments.
using ScoreF32 = ScoreKeys<quant::FloatCodec<float, Plane::kKey>>;
using ScoreF16 = ScoreKeys<quant::FloatCodec<half, Plane::kKey>>;
using ScoreBF16 = ScoreKeys<quant::FloatCodec<bfloat16, Plane::kKey>>;
using ScoreE4M3 = ScoreKeys<quant::FP8Codec<quant::E4M3FN, Plane::kKey>>;
using ScoreE5M2 = ScoreKeys<quant::FP8Codec<quant::E5M2, Plane::kKey>>;
using ScoreInt8 = ScoreKeys<quant::Int8Codec<Plane::kKey>>;
using ScoreQ8_0 = ScoreKeys<quant::Q8_0Codec<Plane::kKey>>;
using ScoreQ4_0 = ScoreKeys<quant::Q4_0Codec<Plane::kKey>>;
using ScoreKivi2 = ScoreKeys<quant::KiviKeyCodec<2, 32>>;
using ScoreKivi4 = ScoreKeys<quant::KiviKeyCodec<4, 32>>;
using ScoreKivi2G64 = ScoreKeys<quant::KiviKeyCodec<2, 64>>;
using ScoreKivi4G128 = ScoreKeys<quant::KiviKeyCodec<4, 128>>;
using ScoreKivi2G128 = ScoreKeys<quant::KiviKeyCodec<2, 128>>;
using ScoreKivi4G64 = ScoreKeys<quant::KiviKeyCodec<4, 64>>;
using ScoreKivi2Token = ScoreKeys<quant::KiviTokenCodec<2, 32, Plane::kKey>>;
using ScoreKivi4Token = ScoreKeys<quant::KiviTokenCodec<4, 32, Plane::kKey>>;
using ScoreNuq2 = ScoreKeys<quant::KVQuantKeyCodec<2>>;
using ScoreNuq3 = ScoreKeys<quant::KVQuantKeyCodec<3>>;
using ScoreNuq4 = ScoreKeys<quant::KVQuantKeyCodec<4>>;
using ScoreRotatedNuq2 = ScoreRotatedKeys<quant::KVQuantKeyCodec<2>>;
using ScoreRotatedNuq3 = ScoreRotatedKeys<quant::KVQuantKeyCodec<3>>;
using ScoreRotatedNuq4 = ScoreRotatedKeys<quant::KVQuantKeyCodec<4>>;
using ScoreRotatedF32 = ScoreRotatedKeys<quant::FloatCodec<float, Plane::kKey>>;
using ScoreRotatedF16 = ScoreRotatedKeys<quant::FloatCodec<half, Plane::kKey>>;
using ScoreRotatedBF16 = ScoreRotatedKeys<quant::FloatCodec<bfloat16, Plane::kKey>>;
using ScoreRotatedE4M3 = ScoreRotatedKeys<quant::FP8Codec<quant::E4M3FN, Plane::kKey>>;
using ScoreRotatedE5M2 = ScoreRotatedKeys<quant::FP8Codec<quant::E5M2, Plane::kKey>>;
using AccumulateF32 = AccumulateValues<quant::FloatCodec<float, Plane::kValue>>;
using AccumulateF16 = AccumulateValues<quant::FloatCodec<half, Plane::kValue>>;
using AccumulateBF16 = AccumulateValues<quant::FloatCodec<bfloat16, Plane::kValue>>;
using AccumulateE4M3 = AccumulateValues<quant::FP8Codec<quant::E4M3FN, Plane::kValue>>;
using AccumulateE5M2 = AccumulateValues<quant::FP8Codec<quant::E5M2, Plane::kValue>>;
using AccumulateInt8 = AccumulateValues<quant::Int8Codec<Plane::kValue>>;
using AccumulateQ8_0 = AccumulateValues<quant::Q8_0Codec<Plane::kValue>>;
using AccumulateQ4_0 = AccumulateValues<quant::Q4_0Codec<Plane::kValue>>;
using AccumulateKivi2 = AccumulateValues<quant::KiviValueCodec<2, 32>>;
using AccumulateKivi4 = AccumulateValues<quant::KiviValueCodec<4, 32>>;
using AccumulateKivi2G64 = AccumulateValues<quant::KiviValueCodec<2, 64>>;
using AccumulateKivi4G128 = AccumulateValues<quant::KiviValueCodec<4, 128>>;
using AccumulateKivi2G128 = AccumulateValues<quant::KiviValueCodec<2, 128>>;
using AccumulateKivi4G64 = AccumulateValues<quant::KiviValueCodec<4, 64>>;
using AccumulateNuq2 = AccumulateValues<quant::KVQuantValueCodec<2>>;
using AccumulateNuq3 = AccumulateValues<quant::KVQuantValueCodec<3>>;
using AccumulateNuq4 = AccumulateValues<quant::KVQuantValueCodec<4>>;
// TurboQuant's rate is a run-time option: one kernel per variant and plane serves every rate.
using ScoreTurboMse = ScoreKeys<quant::TurboCodec<quant::TurboVariant::kMse, Plane::kKey>>;
using ScoreTurboProd = ScoreKeys<quant::TurboCodec<quant::TurboVariant::kProd, Plane::kKey>>;
using AccumulateTurboMse = AccumulateValues<quant::TurboCodec<quant::TurboVariant::kMse, Plane::kValue>>;
using AccumulateTurboProd = AccumulateValues<quant::TurboCodec<quant::TurboVariant::kProd, Plane::kValue>>;
using ScoreQjl = ScoreKeys<quant::QjlKeyCodec>;  // every sketch size
// layout::MLA's page decoders: RoPE keys (bf16 by default), latents in the element and 8-bit formats.
using DecodeRopeF32 = DecodeChannelMajor<quant::FloatCodec<float, Plane::kKey>>;
using DecodeRopeF16 = DecodeChannelMajor<quant::FloatCodec<half, Plane::kKey>>;
using DecodeRopeBF16 = DecodeChannelMajor<quant::FloatCodec<bfloat16, Plane::kKey>>;
using DecodeLatentF32 = DecodeChannelMajor<quant::FloatCodec<float, Plane::kValue>>;
using DecodeLatentF16 = DecodeChannelMajor<quant::FloatCodec<half, Plane::kValue>>;
using DecodeLatentBF16 = DecodeChannelMajor<quant::FloatCodec<bfloat16, Plane::kValue>>;
using DecodeLatentE4M3 = DecodeChannelMajor<quant::FP8Codec<quant::E4M3FN, Plane::kValue>>;
using DecodeLatentQ8_0 = DecodeChannelMajor<quant::Q8_0Codec<Plane::kValue>>;
using DecodeLatentQ4_0 = DecodeChannelMajor<quant::Q4_0Codec<Plane::kValue>>;

// The cache's write path: inputs widened to fp32, pages encoded.
using WidenF16 = WidenToFloat<half>;
using WidenBF16 = WidenToFloat<bfloat16>;
using EncodeF32Keys = EncodePlane<quant::FloatCodec<float, Plane::kKey>>;
using EncodeF32Values = EncodePlane<quant::FloatCodec<float, Plane::kValue>>;
using EncodeF16Keys = EncodePlane<quant::FloatCodec<half, Plane::kKey>>;
using EncodeF16Values = EncodePlane<quant::FloatCodec<half, Plane::kValue>>;
using EncodeBF16Keys = EncodePlane<quant::FloatCodec<bfloat16, Plane::kKey>>;
using EncodeBF16Values = EncodePlane<quant::FloatCodec<bfloat16, Plane::kValue>>;
using EncodeInt8Keys = EncodePlane<quant::Int8Codec<Plane::kKey>>;
using EncodeInt8Values = EncodePlane<quant::Int8Codec<Plane::kValue>>;
using EncodeQ8_0Keys = EncodePlane<quant::Q8_0Codec<Plane::kKey>>;
using EncodeQ8_0Values = EncodePlane<quant::Q8_0Codec<Plane::kValue>>;
using EncodeQ4_0Keys = EncodePlane<quant::Q4_0Codec<Plane::kKey>>;
using EncodeQ4_0Values = EncodePlane<quant::Q4_0Codec<Plane::kValue>>;
using EncodeKivi2Keys = EncodePlane<quant::KiviKeyCodec<2, 32>>;
using EncodeKivi4Keys = EncodePlane<quant::KiviKeyCodec<4, 32>>;
using EncodeKivi2G64Keys = EncodePlane<quant::KiviKeyCodec<2, 64>>;
using EncodeKivi4G128Keys = EncodePlane<quant::KiviKeyCodec<4, 128>>;
using EncodeKivi2G128Keys = EncodePlane<quant::KiviKeyCodec<2, 128>>;
using EncodeKivi4G64Keys = EncodePlane<quant::KiviKeyCodec<4, 64>>;
using EncodeKivi2TokenKeys = EncodePlane<quant::KiviTokenCodec<2, 32, Plane::kKey>>;
using EncodeKivi4TokenKeys = EncodePlane<quant::KiviTokenCodec<4, 32, Plane::kKey>>;
using EncodeKivi2Values = EncodePlane<quant::KiviValueCodec<2, 32>>;
using EncodeKivi4Values = EncodePlane<quant::KiviValueCodec<4, 32>>;
using EncodeKivi2G64Values = EncodePlane<quant::KiviValueCodec<2, 64>>;
using EncodeKivi4G128Values = EncodePlane<quant::KiviValueCodec<4, 128>>;
using EncodeKivi2G128Values = EncodePlane<quant::KiviValueCodec<2, 128>>;
using EncodeKivi4G64Values = EncodePlane<quant::KiviValueCodec<4, 64>>;

}  // namespace kvpack::inline v0::kernels::cpu::precompiled

/// Applies X(kernel) to every precompiled kernel functor.
#define KVPACK_FOR_EACH_PRECOMPILED_KERNEL(X)                                             \
  X(precompiled::ScoreF32) X(precompiled::ScoreF16) X(precompiled::ScoreBF16)             \
  X(precompiled::ScoreE4M3) X(precompiled::ScoreE5M2) X(precompiled::ScoreInt8)           \
  X(precompiled::ScoreQ8_0) X(precompiled::ScoreQ4_0) X(precompiled::AccumulateF32)       \
  X(precompiled::AccumulateF16) X(precompiled::AccumulateBF16)                            \
  X(precompiled::AccumulateE4M3) X(precompiled::AccumulateE5M2)                           \
  X(precompiled::AccumulateInt8) X(precompiled::AccumulateQ8_0)                           \
  X(precompiled::AccumulateQ4_0) X(precompiled::ScoreKivi2) X(precompiled::ScoreKivi4)    \
  X(precompiled::AccumulateKivi2) X(precompiled::AccumulateKivi4) X(precompiled::ScoreKivi2Token)   \
  X(precompiled::ScoreKivi4Token) X(precompiled::ScoreKivi2G64) X(precompiled::ScoreKivi4G128)             \
  X(precompiled::AccumulateKivi2G64) X(precompiled::AccumulateKivi4G128) X(precompiled::ScoreKivi2G128)        \
  X(precompiled::ScoreKivi4G64) X(precompiled::AccumulateKivi2G128) X(precompiled::AccumulateKivi4G64)        \
  X(precompiled::ScoreRotatedF32) X(precompiled::ScoreRotatedF16)         \
  X(precompiled::ScoreRotatedBF16) X(precompiled::ScoreRotatedE4M3) X(precompiled::ScoreRotatedE5M2)     \
  X(precompiled::ScoreNuq2) X(precompiled::ScoreNuq3) X(precompiled::ScoreNuq4)                           \
  X(precompiled::ScoreRotatedNuq2) X(precompiled::ScoreRotatedNuq3) X(precompiled::ScoreRotatedNuq4)      \
  X(precompiled::AccumulateNuq2) X(precompiled::AccumulateNuq3) X(precompiled::AccumulateNuq4)            \
  X(precompiled::ScoreTurboMse) X(precompiled::ScoreTurboProd) X(precompiled::AccumulateTurboMse)         \
  X(precompiled::AccumulateTurboProd) X(precompiled::ScoreQjl) X(SoftmaxUpdate) X(ScoreRows)              \
  X(ScoreRotatedRows) X(precompiled::DecodeRopeF32) X(precompiled::DecodeRopeF16) X(precompiled::DecodeRopeBF16)      \
  X(precompiled::DecodeLatentF32) X(precompiled::DecodeLatentF16) X(precompiled::DecodeLatentBF16)        \
  X(precompiled::DecodeLatentE4M3) X(precompiled::DecodeLatentQ8_0) X(precompiled::DecodeLatentQ4_0)     \
  X(precompiled::WidenF16) X(precompiled::WidenBF16) X(precompiled::EncodeF32Keys)                        \
  X(precompiled::EncodeF32Values) X(precompiled::EncodeF16Keys) X(precompiled::EncodeF16Values)           \
  X(precompiled::EncodeBF16Keys) X(precompiled::EncodeBF16Values) X(precompiled::EncodeInt8Keys)          \
  X(precompiled::EncodeInt8Values) X(precompiled::EncodeQ8_0Keys) X(precompiled::EncodeQ8_0Values)         \
  X(precompiled::EncodeQ4_0Keys) X(precompiled::EncodeQ4_0Values) X(precompiled::EncodeKivi2Keys)            \
  X(precompiled::EncodeKivi4Keys) X(precompiled::EncodeKivi2G64Keys) X(precompiled::EncodeKivi4G128Keys)      \
  X(precompiled::EncodeKivi2TokenKeys) X(precompiled::EncodeKivi4TokenKeys) X(precompiled::EncodeKivi2Values) \
  X(precompiled::EncodeKivi4Values) X(precompiled::EncodeKivi2G64Values) X(precompiled::EncodeKivi4G128Values) \
  X(precompiled::EncodeKivi2G128Keys) X(precompiled::EncodeKivi4G64Keys) X(precompiled::EncodeKivi2G128Values)  \
  X(precompiled::EncodeKivi4G64Values)

namespace kvpack::inline v0::kernels::cpu {

/// True for the kernels KVPACK_FOR_EACH_PRECOMPILED_KERNEL lists.
template <class Kernel>
struct is_precompiled : std::false_type {};

#define KVPACK_MARK_PRECOMPILED(Kernel) \
  template <>                           \
  struct is_precompiled<Kernel> : std::true_type {};
KVPACK_FOR_EACH_PRECOMPILED_KERNEL(KVPACK_MARK_PRECOMPILED)
#undef KVPACK_MARK_PRECOMPILED

}  // namespace kvpack::inline v0::kernels::cpu

/// Explicit instantiation (definition or, with `extern`, declaration) of one kernel for one arch.
#define KVPACK_INSTANTIATE_KERNEL_FOR(Arch, Kernel) \
  template void Kernel::operator()<Arch>(Arch, const Kernel::args_type&) const noexcept;
#define KVPACK_EXTERN_KERNEL_FOR(Arch, Kernel) \
  extern template void Kernel::operator()<Arch>(Arch, const Kernel::args_type&) const noexcept;
