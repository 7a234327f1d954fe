#pragma once
/// \file kernels_impl.hpp
/// \brief Bodies of the CPU kernel functors: each forwards to the overload for its codec.

#include "kvpack/kernels/cpu/channel_major.hpp"
#include "kvpack/kernels/cpu/convert.hpp"
#include "kvpack/kernels/cpu/encode_int8.hpp"
#include "kvpack/kernels/cpu/encode_kivi.hpp"
#include "kvpack/kernels/cpu/encode_q4_0.hpp"
#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/integer.hpp"
#include "kvpack/kernels/cpu/isa.hpp"
#include "kvpack/kernels/cpu/kivi.hpp"
#include "kvpack/kernels/cpu/kvquant.hpp"
#include "kvpack/kernels/cpu/q4_0.hpp"
// After every codec's kernels: the pre-RoPE scorer picks up their decode_key_rows overloads.
#include "kvpack/kernels/cpu/rope.hpp"
#include "kvpack/kernels/cpu/kernels.hpp"
#include "kvpack/kernels/cpu/softmax.hpp"
#include "kvpack/kernels/cpu/turboquant.hpp"

namespace kvpack::inline v0::kernels::cpu {

template <class KeyCodec>
template <class Arch>
void ScoreKeys<KeyCodec>::operator()(Arch arch, const args_type& args) const noexcept {
  score_keys(arch, std::type_identity<KeyCodec>{}, args);
}

template <class ValueCodec>
template <class Arch>
void AccumulateValues<ValueCodec>::operator()(Arch arch, const args_type& args) const noexcept {
  accumulate_values(arch, std::type_identity<ValueCodec>{}, args);
}

template <class Arch>
void SoftmaxUpdate::operator()(Arch arch, const args_type& args) const noexcept {
  softmax_update(arch, args);
}

template <class Arch>
void ScoreRows::operator()(Arch arch, const args_type& args) const noexcept {
  score_rows(arch, args);
}

template <class KeyCodec>
template <class Arch>
void ScoreRotatedKeys<KeyCodec>::operator()(Arch arch, const args_type& args) const noexcept {
  score_rotated_keys(arch, std::type_identity<KeyCodec>{}, args);
}

template <class Arch>
void ScoreRotatedRows::operator()(Arch arch, const args_type& args) const noexcept {
  score_rotated_rows(arch, args);
}

template <class Codec>
template <class Arch>
void DecodeChannelMajor<Codec>::operator()(Arch arch, const args_type& args) const noexcept {
  decode_channel_major(arch, std::type_identity<Codec>{}, args);
}

template <class T>
template <class Arch>
void WidenToFloat<T>::operator()(Arch arch, const args_type& args) const noexcept {
  widen_to_float(arch, args);
}

template <class Codec>
template <class Arch>
void EncodePlane<Codec>::operator()(Arch arch, const args_type& args) const noexcept {
  encode_plane(arch, std::type_identity<Codec>{}, args);
}

/// Whether EncodePlane<Codec> has a kernel: an encode_plane overload for Codec.
template <class Codec>
inline constexpr bool has_plane_encoder_v = requires(const EncodeRowsArgs& args) {
  encode_plane(default_arch{}, std::type_identity<Codec>{}, args);
};

}  // namespace kvpack::inline v0::kernels::cpu
