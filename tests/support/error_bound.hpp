#pragma once
// The bound on |kernel - exact attention on the decoded values| for one query head, from the
// kernels' arithmetic (see kernels/cpu/integer.hpp and q4_0.hpp):
// - fp32 accumulation in a different order: relative 1e-5 of the largest value;
// - fp32 scores: each within (d + 6)·2⁻²⁴·max_t Σ_c |q_c·k̂_tc|·scale of the exact one, which
//   moves the output like δ below (it adds to δ): large scores make this the leading term;
// - on the integer paths (AVX-512; AVX2 for int8, q8_0 and q4_0) the quantized query moves each
//   score by at most δ: with int16 (8-bit codes) δ = max|q|/65534 · max_t Σ_c |k̂_tc|; with int8
//   per 32-channel block (q4_0) δ = max_t Σ_b (max_{c∈b} |q_c| / 254) · Σ_{c∈b} |k̂_tc|. Each
//   normalised weight then moves by a factor within e^{±2δ}: output error ≤ 2(e^{2δ} - 1)·max|v̂|;
// - the quantized weights: each off by ≤ half a step, the step being (page max of p) · (page
//   max of the value scale) / kMax, kMax = 32767 (int16) or 127 (int8). Summed over a page of P
//   slots, over pages, and divided by l = Σ p: Σ_pages P · (0.5/kMax) · max_p(page) ·
//   max|v̂|(page) / l, times e^{4δ} for the kernel's own (perturbed) weights.
// - KIVI-2 and KIVI-4 on AVX-512 (kernels/cpu/kivi_vnni.hpp) quantize the operand that multiplies the raw
//   codes instead: q·s to int16 per head, so δ_t = max_c |q_c·s_tc| / 65534 · Σ_c code_tc
//   (kInt16Codes); and w·s to int8 per page, head and channel group with the step
//   (page max of p) · (group's max |s|) / 127, so each sum moves by at most (page max of p) / 254 ·
//   M, M = max_c (max_t |s_{t,c}|) · Σ_t code_tc over the page (page_code_mass; kInt8Codes).
//   Scales, ranges and norms are taken by magnitude: a page admitted with PageCheck::kFinite may
//   hold negative ones.
// - KVQuant's values on AVX-512 (kernels/cpu/kvquant.hpp) take the same int8
//   weights, w·r with the step (page max of p) · (page max of r) / 127, times the codebook's
//   levels as bytes, each within max|ℓ|/254 of its level. Per channel the page's sum moves by
//   at most P · step/2 · max|ℓ| + Σ_t w_t·r_t · max|ℓ|/254 ≤ (page max of p) / 254 · M with
//   M = 2·P·(page max of r), as every codebook lies on [−1, 1] (quant/nuq.hpp).
// - KVQuant's keys on AVX-512 take q·r (r: the channel's calibrated half-range) as
//   int16 per head times the levels as bytes: δ = d·max_c |q_c·r_c| / 65534 + Σ_c |q_c·r_c| · e
//   (kInt16Levels; r_c taken as the channel's largest over every layer and head of the tables),
//   e = max_k |ℓ_k − byte copy of ℓ_k| ≤ max|ℓ| / 254: 0 up to float rounding for a codebook on
//   the bytes' grid (stream_fixture.hpp's byte_grid_levels).
// - TurboQuant-MSE's keys on AVX-512 (kernels/cpu/turboquant_vnni.hpp) take the rotated query Rq
//   as int8 per head times the centroids as bytes: with n_t the token's norm and C its centroids,
//   δ_t = n_t·e·‖Rq‖₁ + max|Rq|/254 · (‖R k̂_t‖₁ + d·n_t·e), e the centroids' largest byte
//   rounding (n_t·C = R k̂_t; kInt8Levels). Prod's and QJL's keys add their sign sums with the
//   sketched query z = S·(R)q as int8 (summed in fp32 first): f_t·m·max|z|/254 more (and the
//   fp32 sum's rounding), f_t the token's sign factor
//   (√(π/2)/d·n_t·γ_t or √(π/2)/m·n_t). Its values take KVQuant's int8 weights with the norms
//   as ranges: per rotated channel a page's sum moves by at most (page max of p) / 254 ·
//   2.01·P·(page max of n)·max|C| (each weight by half a step, each level by at most max|C|/254),
//   and un-rotating spreads that over the channels, at most √d times it on one (kInt8Codes).

#include <algorithm>
#include <cmath>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvpack/dispatch.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/kivi.hpp"
#include "kvpack/quant/kvquant.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"
#include "kvpack/quant/turboquant.hpp"

namespace kvpack::test {

/// How the kernel under test computes with a plane: in fp32, through int16 / int8 operands,
/// through int16 / int8 operands that multiply raw codes (KIVI's keys / values), or through an
/// int16 query that multiplies byte levels (KVQuant's keys; its values are kInt8Codes), or
/// through an int8 query that multiplies byte levels (TurboQuant-MSE's keys; values kInt8Codes).
enum class Operands { kFloat, kInt16, kInt8, kInt16Codes, kInt8Codes, kInt16Levels, kInt8Levels };

/// KIVI's channel-grouped keys and token-grouped values, which the VNNI path multiplies as raw
/// codes (its per-token keys are decoded to fp32 instead).
template <class Codec>
struct IsKiviCodes : std::false_type {};
template <int Bits, int Group>
struct IsKiviCodes<quant::KiviKeyCodec<Bits, Group>> : std::true_type {
  static constexpr int kBits = Bits;
};
template <int Bits, int Group>
struct IsKiviCodes<quant::KiviValueCodec<Bits, Group>> : std::true_type {
  static constexpr int kBits = Bits;
};

/// KVQuant's planes, whose codes the integer paths multiply as byte levels (3-bit ones widened).
template <class Codec>
struct IsKVQuantByteLevels : std::false_type {};
template <int Bits>
struct IsKVQuantByteLevels<quant::KVQuantKeyCodec<Bits>> : std::true_type {};
template <int Bits>
struct IsKVQuantByteLevels<quant::KVQuantValueCodec<Bits>> : std::true_type {};

/// TurboQuant-MSE's planes, whose centroids the VNNI path multiplies as bytes (where every
/// channel of a 32-channel section has a 4-, 3- or 2-bit code; the bound holds for the fp32 path too).
template <class Codec>
struct IsTurboMse : std::false_type {};
template <Plane kPlane>
struct IsTurboMse<quant::TurboCodec<quant::TurboVariant::kMse, kPlane>> : std::true_type {};

/// TurboQuant-Prod's and QJL's keys, whose signs the VNNI path multiplies as 0/1 bytes with the
/// sketched query as int8 (Prod's codes as MSE's).
template <class Codec>
struct IsTurboSignKeys : std::false_type {};
template <>
struct IsTurboSignKeys<quant::TurboCodec<quant::TurboVariant::kProd, Plane::kKey>> : std::true_type {};
template <>
struct IsTurboSignKeys<quant::QjlKeyCodec> : std::true_type {};

/// The operands the kernels of target `isa` (kernels::cpu::isa_name) use for a codec's plane: on
/// AVX-512 with VNNI and on AVX2, int16 for int8 and q8_0, int8 for q4_0 and KIVI's forms above,
/// KVQuant's too; on AVX-512 also TurboQuant's; fp32 everywhere else. For pages of a multiple of
/// 16 tokens (every cache's): other page sizes, and int8 values at head_dim 8, take the fp32
/// path, whose bound the integer one contains.
template <class Codec>
Operands operands(std::string_view isa) {
  if (isa != "avx512" && isa != "avx2") return Operands::kFloat;
  if constexpr (std::is_same_v<Codec, quant::Q4_0Codec<Codec::kPlane>>) return Operands::kInt8;
  if constexpr (std::is_same_v<Codec, quant::Q8_0Codec<Codec::kPlane>> ||
                std::is_same_v<Codec, quant::Int8Codec<Codec::kPlane>>) {
    return Operands::kInt16;
  }
  if constexpr (IsKiviCodes<Codec>::value) return Codec::kPlane == Plane::kKey ? Operands::kInt16Codes : Operands::kInt8Codes;
  if constexpr (IsKVQuantByteLevels<Codec>::value) {
    return Codec::kPlane == Plane::kKey ? Operands::kInt16Levels : Operands::kInt8Codes;
  }
  if (isa != "avx512") return Operands::kFloat;
  if constexpr (IsTurboMse<Codec>::value) {
    return Codec::kPlane == Plane::kKey ? Operands::kInt8Levels : Operands::kInt8Codes;
  }
  if constexpr (IsTurboSignKeys<Codec>::value) return Operands::kInt8Levels;
  return Operands::kFloat;
}

/// The CUDA kernels' name for operands(): they compute in fp32.
inline constexpr std::string_view kCudaKernels = "cuda";

/// The same for the kernels attend() runs on this CPU.
template <class Codec>
Operands active_operands() {
  return operands<Codec>(dispatch::active_cpu_isa());
}

/// Every live token a head attends over: decoded key and value, and its page (-1: the tail).
struct DecodedTokens {
  std::vector<std::vector<float>> keys, values;
  std::vector<int> page_of;
  std::vector<double> page_max_value;  // per page, over all its slots (dead ones included)
  int page_size = 0;
  // KIVI keys: per token, each channel's scale and code (empty for tokens without codes);
  // KVQuant keys: each channel's half-range in key_scales.
  std::vector<std::vector<float>> key_scales, key_codes;
  // TurboQuant and QJL keys: the layer's tables, and per token {n_t, ‖n_t·C(code_t)‖₁, the sign
  // factor f_t} (n_t and the codes' norm 0 for QJL, f_t 0 for MSE; empty for the tail's tokens).
  const quant::turbo_detail::LayerView* turbo_layer = nullptr;
  bool turbo_qjl = false;  // QJL sketches the query itself, Prod the rotated one
  std::vector<std::vector<double>> turbo_keys;
  double key_level_error = 1.0 / 254.0;  // KVQuant and TurboQuant keys: e above
  // KIVI values: per page, M = max_c (max_t |s_{t,c}|) · Σ_t code_tc over all its slots; KVQuant
  // values: M = 2·P·(page max of |r|); TurboQuant values: M = 2.01·√d·P·(page max of |n|)·max|C|.
  std::vector<double> page_code_mass;
};

/// The largest distance of a TurboQuant layer's centroid from the kernel's byte copy of it
/// (byte_levels.hpp: step · round(C / step), step = max|C| / 127 in float over both widths, which
/// share one step).
inline double turbo_level_error(const quant::turbo_detail::LayerView& v) {
  float largest = 0.0f;
  for (const float* centroids : {v.high_centroids, v.low_centroids}) {
    for (int k = 0; k < quant::turbo_detail::kMaxLevels; ++k) largest = std::max(largest, std::fabs(centroids[k]));
  }
  if (largest == 0.0f) return 0.0;
  const float step = largest / 127.0f;
  double error = 0.0;
  for (const float* centroids : {v.high_centroids, v.low_centroids}) {
    for (int k = 0; k < quant::turbo_detail::kMaxLevels; ++k) {
      const double copy = static_cast<double>(step) * static_cast<double>(std::lrint(centroids[k] / step));
      error = std::max(error, std::fabs(centroids[k] - copy));
    }
  }
  return error;
}

/// What the kInt16Codes, kInt16Levels and kInt8Codes bounds need from page `plane` for its
/// token t (keys) or for the whole page (values); nothing for other codecs.
template <class Codec>
void add_key_codes([[maybe_unused]] const Codec& codec, [[maybe_unused]] const typename Codec::params_type& params,
                   quant::PageGeometry g, const std::byte* plane, int t, DecodedTokens& tokens) {
  std::vector<float> scales, codes;
  std::vector<double> turbo;
  if constexpr ((IsTurboMse<Codec>::value && Codec::kPlane == Plane::kKey) || IsTurboSignKeys<Codec>::value) {
    namespace td = quant::turbo_detail;
    const td::LayerView& v = td::layer_view(params, g.head_dim);
    const auto slot = static_cast<std::size_t>(t);
    const double n = td::load_half(plane + v.norms_offset(g.page_size) + 2 * slot);
    double codes_l1 = 0.0;  // ‖C(code_t)‖₁: R k̂_t's MSE part over n_t
    const std::byte* row = plane + v.row_bytes() * slot;
    for (index_t c = 0; c < g.head_dim; ++c) {
      const int bits = v.bits_of(c);
      if (bits == 0) continue;
      const float* centroids = c < v.high_channels ? v.high_centroids : v.low_centroids;
      codes_l1 += std::fabs(centroids[td::get_bits(row, v.bit_offset(c), bits)]);
    }
    double sign_factor = 0.0;
    if constexpr (std::is_same_v<Codec, quant::QjlKeyCodec>) {
      sign_factor = td::kSqrtHalfPi / v.sketch_rows * n;
      tokens.turbo_qjl = true;
      turbo = {0.0, 0.0, sign_factor};
    } else {
      if constexpr (IsTurboSignKeys<Codec>::value) {
        sign_factor = td::kSqrtHalfPi / g.head_dim * n * td::load_half(plane + v.gammas_offset(g.page_size) + 2 * slot);
      }
      turbo = {n, std::fabs(n) * codes_l1, sign_factor};
    }
    tokens.turbo_layer = &v;
    tokens.key_level_error = turbo_level_error(v);
  }
  tokens.turbo_keys.push_back(std::move(turbo));
  if constexpr (IsKiviCodes<Codec>::value && Codec::kPlane == Plane::kKey) {
    for (int c = 0; c < g.head_dim; ++c) {
      const std::size_t meta = (static_cast<std::size_t>(t / Codec::kGroup) * g.head_dim + c) * 2;
      scales.push_back(quant::kivi_detail::get_half(plane + Codec::scales_offset(g) + meta));
      codes.push_back(quant::kivi_detail::get_code<IsKiviCodes<Codec>::kBits>(plane + Codec::row_bytes(g) * c, t));
    }
  }
  if constexpr (IsKVQuantByteLevels<Codec>::value && Codec::kPlane == Plane::kKey) {
    const std::vector<float>& ranges = codec.tables->key_half_range;  // [layers][kv_heads][head_dim]
    scales.assign(static_cast<std::size_t>(g.head_dim), 0.0f);
    const auto d = static_cast<std::size_t>(g.head_dim);
    for (std::size_t i = 0; i < ranges.size(); ++i) scales[i % d] = std::max(scales[i % d], ranges[i]);
    // The kernel's byte copy: level k as step · round(ℓ_k / step), step = max|ℓ| / 127 in float.
    tokens.key_level_error = 0.0;
    for (const quant::nuq::Codebook& codebook : codec.tables->key_codebook) {
      float largest = 0.0f;
      for (float level : codebook.levels) largest = std::max(largest, std::fabs(level));
      const float step = largest / 127.0f;
      for (float level : codebook.levels) {
        const double copy = static_cast<double>(step) * static_cast<double>(std::lrint(level / step));
        tokens.key_level_error = std::max(tokens.key_level_error, std::fabs(level - copy));
      }
    }
  }
  tokens.key_scales.push_back(std::move(scales));
  tokens.key_codes.push_back(std::move(codes));
}

template <class Codec>
void add_value_code_mass(const Codec&, [[maybe_unused]] const typename Codec::params_type& params,
                         quant::PageGeometry g, const std::byte* plane, DecodedTokens& tokens) {
  double mass = 0.0;
  if constexpr (IsTurboMse<Codec>::value && Codec::kPlane == Plane::kValue) {
    const quant::turbo_detail::LayerView& v = quant::turbo_detail::layer_view(params, g.head_dim);
    double norm_max = 0.0, centroid_max = 0.0;
    for (int t = 0; t < g.page_size; ++t) {
      norm_max = std::max(norm_max, static_cast<double>(std::fabs(quant::turbo_detail::load_half(
                                        plane + v.norms_offset(g.page_size) + 2 * static_cast<std::size_t>(t)))));
    }
    for (int k = 0; k < quant::turbo_detail::kMaxLevels; ++k) {
      centroid_max = std::max({centroid_max, std::fabs(static_cast<double>(v.high_centroids[k])),
                               std::fabs(static_cast<double>(v.low_centroids[k]))});
    }
    mass = 2.01 * std::sqrt(static_cast<double>(g.head_dim)) * g.page_size * norm_max * centroid_max;
  }
  if constexpr (IsKiviCodes<Codec>::value && Codec::kPlane == Plane::kValue) {
    const int groups = g.head_dim / Codec::kGroup;
    for (int c = 0; c < g.head_dim; ++c) {
      double scale_max = 0.0, code_sum = 0.0;
      for (int t = 0; t < g.page_size; ++t) {
        const std::size_t meta = (static_cast<std::size_t>(t) * groups + c / Codec::kGroup) * 2;
        const float scale = quant::kivi_detail::get_half(plane + Codec::scales_offset(g) + meta);
        scale_max = std::max(scale_max, static_cast<double>(std::fabs(scale)));  // any sign (a kFinite page)
        code_sum += quant::kivi_detail::get_code<IsKiviCodes<Codec>::kBits>(plane + Codec::row_bytes(g) * t, c);
      }
      mass = std::max(mass, scale_max * code_sum);
    }
  }
  if constexpr (IsKVQuantByteLevels<Codec>::value && Codec::kPlane == Plane::kValue) {
    double range_max = 0.0;
    for (int t = 0; t < g.page_size; ++t) {
      const std::uint16_t bits = quant::kvquant_detail::get_u16(plane + Codec::ranges_offset(g) + 2 * t);
      range_max = std::max(range_max, std::fabs(static_cast<double>(half::from_bits(bits))));
    }
    mass = 2.0 * g.page_size * range_max;
  }
  tokens.page_code_mass.push_back(mass);
}

/// How far the kernel may move token t's score q·k̂ (times `scale`) through its key operands
/// (0 for fp32 ones, whose rounding the callers bound separately).
inline double score_error_bound(const DecodedTokens& tokens, std::size_t t, const float* q, int head_dim, double scale,
                                Operands key_operands) {
  const auto& key = tokens.keys[t];
  if (key_operands == Operands::kInt16) {
    double max_query = 0.0, l1 = 0.0;
    for (int c = 0; c < head_dim; ++c) {
      max_query = std::max(max_query, static_cast<double>(std::fabs(q[c])));
      l1 += std::fabs(key[c]);
    }
    return max_query / 65534.0 * l1 * scale;
  }
  if (key_operands == Operands::kInt8) {
    double blockwise = 0.0;
    for (int b = 0; b < head_dim / 32; ++b) {
      double q_max = 0.0, k_l1 = 0.0;
      for (int c = 32 * b; c < 32 * b + 32; ++c) {
        q_max = std::max(q_max, static_cast<double>(std::fabs(q[c])));
        k_l1 += std::fabs(key[c]);
      }
      blockwise += q_max / 254.0 * k_l1;
    }
    return blockwise * scale;
  }
  if (key_operands == Operands::kInt16Codes && t < tokens.key_codes.size() && !tokens.key_codes[t].empty()) {
    double qs_max = 0.0, codes = 0.0;
    for (int c = 0; c < head_dim; ++c) {
      qs_max = std::max(qs_max, std::fabs(static_cast<double>(q[c]) * tokens.key_scales[t][c]));
      codes += tokens.key_codes[t][c];
    }
    return qs_max / 65534.0 * codes * scale * (1.0 + 1e-4);  // fp32 products and steps
  }
  if (key_operands == Operands::kInt8Levels && t < tokens.turbo_keys.size() && !tokens.turbo_keys[t].empty()) {
    const quant::turbo_detail::LayerView& v = *tokens.turbo_layer;
    std::vector<float> rotated(q, q + head_dim);
    if (!tokens.turbo_qjl) quant::rotate(v.rotation, q, rotated.data());
    double l1 = 0.0, largest = 0.0;
    for (float x : rotated) {
      l1 += std::fabs(x);
      largest = std::max(largest, static_cast<double>(std::fabs(x)));
    }
    const double n = std::fabs(tokens.turbo_keys[t][0]), e = tokens.key_level_error;
    double bound = n * e * l1 + largest / 254.0 * (tokens.turbo_keys[t][1] + head_dim * n * e);
    if (tokens.turbo_keys[t][2] != 0.0) {
      // The sketched query z = S·(R)q, summed in fp32 (each z_j within δ_j = (d + 16)·2⁻²⁴·Σ_c |S_jc·x_c|)
      // then int8: each of the m sign products moves by at most δ_j + max|z̃|/254, max|z̃| ≤ max|z| + max δ.
      double z_max = 0.0, rounding_sum = 0.0, rounding_max = 0.0;
      for (index_t j = 0; j < v.sketch_rows; ++j) {
        double z = 0.0, magnitude = 0.0;
        const float* row = v.sketch + static_cast<std::size_t>(j) * head_dim;
        for (int c = 0; c < head_dim; ++c) {
          z += static_cast<double>(row[c]) * rotated[c];
          magnitude += std::fabs(static_cast<double>(row[c]) * rotated[c]);
        }
        const double rounding = (head_dim + 16) * 0x1p-24 * magnitude;
        z_max = std::max(z_max, std::fabs(z));
        rounding_sum += rounding;
        rounding_max = std::max(rounding_max, rounding);
      }
      bound += std::fabs(tokens.turbo_keys[t][2]) * (rounding_sum + v.sketch_rows * (z_max + rounding_max) / 254.0);
    }
    return bound * scale * (1.0 + 1e-4);
  }
  if (key_operands == Operands::kInt16Levels && t < tokens.key_scales.size() && !tokens.key_scales[t].empty()) {
    double qr_max = 0.0, qr_sum = 0.0;
    for (int c = 0; c < head_dim; ++c) {
      const double qr = std::fabs(static_cast<double>(q[c]) * tokens.key_scales[t][c]);
      qr_max = std::max(qr_max, qr);
      qr_sum += qr;
    }
    return (head_dim * qr_max / 65534.0 + qr_sum * tokens.key_level_error) * scale * (1.0 + 1e-4);
  }
  return 0.0;
}

inline double attention_error_bound(const DecodedTokens& tokens, const float* q, int head_dim, double scale,
                                    Operands key_operands, Operands value_operands) {
  double max_value = 0.0;
  for (const auto& row : tokens.values) {
    for (float x : row) max_value = std::max(max_value, static_cast<double>(std::fabs(x)));
  }
  double delta = 0.0, magnitude = 0.0;
  std::vector<double> scores;
  for (std::size_t t = 0; t < tokens.keys.size(); ++t) {
    double s = 0.0, a = 0.0;
    for (int c = 0; c < head_dim; ++c) {
      s += static_cast<double>(q[c]) * tokens.keys[t][c];
      a += std::fabs(static_cast<double>(q[c]) * tokens.keys[t][c]);
    }
    scores.push_back(s * scale);
    magnitude = std::max(magnitude, a * std::fabs(scale));
    delta = std::max(delta, score_error_bound(tokens, t, q, head_dim, scale, key_operands));
  }
  // fp32 scores: the dot product's rounding (at most d products and sums), the scale's, and the
  // subtraction of the (equally rounded) running maximum, each relative 2⁻²⁴ of at most `magnitude`.
  delta += (head_dim + 6) * 0x1p-24 * magnitude;
  double bound = 1e-5 * max_value + 1e-6;
  // A δ large enough to overflow e^{2δ} leaves the bound infinite, never NaN: the factors below
  // multiply terms that may be 0 (no value, or pages whose weights all underflowed).
  if (delta > 0.0 && max_value > 0.0) bound += 2.0 * std::expm1(2.0 * delta) * max_value;
  if (value_operands != Operands::kFloat && !scores.empty()) {
    const double k_max = value_operands == Operands::kInt16 ? 32767.0 : 127.0;
    const double top = *std::max_element(scores.begin(), scores.end());
    double l = 0.0;
    std::vector<double> page_max_p(tokens.page_max_value.size(), 0.0);
    for (std::size_t t = 0; t < scores.size(); ++t) {
      const double p = std::exp(scores[t] - top);
      l += p;
      if (tokens.page_of[t] >= 0) page_max_p[tokens.page_of[t]] = std::max(page_max_p[tokens.page_of[t]], p);
    }
    double weights_error = 0.0;
    for (std::size_t i = 0; i < page_max_p.size(); ++i) {
      weights_error += value_operands == Operands::kInt8Codes
                           ? page_max_p[i] / 254.0 * tokens.page_code_mass[i] * (1.0 + 1e-4)
                           : tokens.page_size * 0.5 / k_max * page_max_p[i] * tokens.page_max_value[i];
    }
    if (weights_error > 0.0) bound += std::exp(4.0 * delta) * weights_error / l;
  }
  return bound;
}

}  // namespace kvpack::test
