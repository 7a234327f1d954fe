#pragma once
/// \file kivi.hpp
/// \brief Decode-attention kernels for quant::KIVI, fused with the unpacking: scores and sums
///        are computed straight from the packed codes, never from decoded keys or values.
///
/// The per-group affine map x̂ = s·code + m is folded into the operand that multiplies the codes
/// (ALGORITHMS.md §1):
/// - keys (per channel c, one (s_c, m_c) per group of tokens):
///   Σ_c q_c·x̂_tc = Σ_c (q_c·s_c)·code_tc + Σ_c q_c·m_c, so the query is scaled once per token
///   group and the second sum is one number per head and group;
/// - values (per token t, one (s_t, m_t) per group of channels):
///   Σ_t w_t·x̂_tc = Σ_t (w_t·s_t)·code_tc + Σ_t w_t·m_t, so each weight is scaled once per token
///   and channel group, and the second sum is added once per call.
/// What is left per code is a shift, a mask, a conversion and one FMA per query head; on AVX-512
/// with VNNI and on AVX2 the codes take integer dot products instead (kivi_vnni.hpp,
/// kivi_avx2.hpp; KiviIntegerKernels). Codes are
/// taken from whole vectors of bytes in a permuted order (KiviLanes); scores and sums are put
/// back in order once per page or call. The per-token keys of KIVI's ablation still unpack a page
/// into an fp32 tile and score it with the float kernels.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/group_blocks.hpp"
#include "kvpack/kernels/cpu/kivi_avx2.hpp"
#include "kvpack/kernels/cpu/kivi_vnni.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"
#include "kvpack/kernels/cpu/softmax.hpp"
#include "kvpack/quant/kivi.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// Every byte's 8/b codes as floats, little-end first (KIVI packs code j at bit b·j): unpacking
/// is one table row copied per byte instead of a shift, mask and convert per code.
template <int Bits>
struct KiviCodeTable {
  float codes[256][8 / Bits];
};

/// One table per arch (the template argument keeps each ISA's object file's copy its own).
template <int Bits, class A>
inline constexpr KiviCodeTable<Bits> kKiviCodeTable = [] {
  KiviCodeTable<Bits> table{};
  for (int byte = 0; byte < 256; ++byte) {
    for (int j = 0; j < 8 / Bits; ++j) {
      table.codes[byte][j] = static_cast<float>((byte >> (Bits * j)) & ((1 << Bits) - 1));
    }
  }
  return table;
}();

KVPACK_ALWAYS_INLINE float kivi_half(const std::byte* at) noexcept {
  std::uint16_t bits;
  std::memcpy(&bits, at, sizeof(bits));
  return half::from_bits(bits);
}

/// Whether rows of `count` codes unpack with whole vectors of A: each of a byte's 8/b codes gives
/// one "slice" (code j of every byte), which must be whole vectors, and one vector of bytes
/// (8/b · W codes) must stay inside one scale group.
template <int Bits, class A>
constexpr bool slices_fit(index_t count, index_t group) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  constexpr index_t kPerByte = 8 / Bits;
  return (count / kPerByte) % kWidth == 0 && group % (kPerByte * kWidth) == 0;
}

/// Where the sliced order puts code e of a row of `count`: slice e % (8/b), then byte e / (8/b).
template <int Bits>
constexpr index_t sliced_position(index_t e, index_t count) noexcept {
  constexpr index_t kPerByte = 8 / Bits;
  return e % kPerByte * (count / kPerByte) + e / kPerByte;
}

/// `count` codes of a packed row as x̂ = code · scale + min (`group` consecutive codes share one
/// fp16 scale and minimum, at `scales[g]`/`mins[g]`, `meta_stride` bytes apart). When
/// slices_fit, in the *sliced* order (sliced_position): whole vectors of bytes are widened, each
/// slice shifted out and masked, no per-code work. Otherwise in row order, one table row per byte.
template <int Bits, class A>
KVPACK_ALWAYS_INLINE void unpack_kivi_row(const std::byte* row, index_t count, index_t group, const std::byte* scales,
                                          const std::byte* mins, std::size_t meta_stride, float* out) noexcept {
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  constexpr index_t kPerByte = 8 / Bits;
  if (slices_fit<Bits, A>(count, group)) {
    const index_t bytes = count / kPerByte;
    const auto* data = reinterpret_cast<const std::uint8_t*>(row);
    const simd::i32<A> mask((1 << Bits) - 1);
    for (index_t q0 = 0; q0 < bytes; q0 += kWidth) {
      const simd::i32<A> packed = simd::load_u8<A>(data + q0);
      const index_t g = kPerByte * q0 / group;
      const batch scale(kivi_half(scales + g * meta_stride));
      const batch min(kivi_half(mins + g * meta_stride));
      KVPACK_UNROLL
      for (index_t j = 0; j < kPerByte; ++j) {
        const batch codes = xsimd::to_float((packed >> static_cast<int>(Bits * j)) & mask);
        xsimd::fma(codes, scale, min).store_unaligned(out + j * bytes + q0);
      }
    }
    return;
  }
  const KiviCodeTable<Bits>& table = kKiviCodeTable<Bits, A>;
  for (index_t k = 0; k < count / kPerByte; ++k) {
    std::memcpy(out + k * kPerByte, table.codes[static_cast<unsigned>(row[k])], sizeof(table.codes[0]));
  }
  for (index_t g = 0; g < count / group; ++g) {
    const batch scale(kivi_half(scales + g * meta_stride));
    const batch min(kivi_half(mins + g * meta_stride));
    // Group sizes (32..128) are multiples of every vector width.
    for (index_t i = g * group; i < (g + 1) * group; i += kWidth) {
      xsimd::fma(batch::load_unaligned(out + i), scale, min).store_unaligned(out + i);
    }
  }
}

/// How vectors of A take codes from a packed KIVI row in the fused kernels. A *chunk* of
/// kChunkBytes consecutive bytes of one scale group fills the W 32-bit lanes (repeated kRepeat
/// times when the group is shorter than W: 2-bit groups of 32 on AVX-512), and kVectors vectors
/// of codes are shifted out of it: lane l of vector J holds the code at bits
/// Bits·(l / kChunkBytes + kRepeat·J) of byte l % kChunkBytes, element `element(J, l)` of the chunk.
template <int Bits, int Group, class A>
struct KiviLanes {
  static constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  static constexpr index_t kPerByte = 8 / Bits;
  static constexpr index_t kGroupBytes = Group * Bits / 8;
  static constexpr index_t kChunkBytes = kGroupBytes < kWidth ? kGroupBytes : kWidth;
  static constexpr index_t kChunks = kGroupBytes / kChunkBytes;  ///< per scale group
  static constexpr index_t kRepeat = kWidth / kChunkBytes;
  static constexpr int kVectors = static_cast<int>(kPerByte / kRepeat);
  static constexpr index_t kChunkElements = kChunkBytes * kPerByte;
  static_assert(kVectors >= 1 && kVectors * kWidth == kChunkElements, "a chunk's codes fill whole vectors");

  static constexpr index_t element(index_t vector, index_t lane) noexcept {
    return lane % kChunkBytes * kPerByte + lane / kChunkBytes + kRepeat * vector;
  }

  /// The chunk at `p`, one byte per lane (kRepeat copies side by side).
  static KVPACK_ALWAYS_INLINE simd::i32<A> load(const std::uint8_t* p) noexcept {
    if constexpr (kRepeat == 1) {
      return simd::load_u8<A>(p);
    } else {
#if XSIMD_WITH_AVX512BW
      static_assert(kRepeat == 2 && std::is_same_v<A, xsimd::avx512bw>, "only AVX-512 vectors outgrow a group");
      std::uint64_t bytes;
      std::memcpy(&bytes, p, sizeof(bytes));
      return _mm512_cvtepu8_epi32(_mm_set1_epi64x(static_cast<long long>(bytes)));
#else
      static_assert(kRepeat == 1, "only AVX-512 vectors outgrow a group");
#endif
    }
  }

  /// Vector J of a loaded chunk's codes, as floats.
  template <int J>
  static KVPACK_ALWAYS_INLINE simd::f32<A> codes(simd::i32<A> packed) noexcept {
    const simd::i32<A> mask((1 << Bits) - 1);
    if constexpr (kRepeat == 1) {
      if constexpr (J == 0) return xsimd::to_float(packed & mask);
      // The top code of a zero-extended byte has nothing above it to mask.
      if constexpr (J == kVectors - 1) return xsimd::to_float(packed >> (Bits * J));
      return xsimd::to_float((packed >> (Bits * J)) & mask);
    } else {
#if XSIMD_WITH_AVX512BW
      const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi32(Bits * kRepeat * J),
                                                _mm256_set1_epi32(Bits * (1 + kRepeat * J)), 1);
      return xsimd::to_float(simd::i32<A>(_mm512_srlv_epi32(packed, shifts)) & mask);
#endif
    }
  }
};

/// Calls f(std::integral_constant<int, J>{}) for J = 0 .. N - 1.
template <int N, class F>
KVPACK_ALWAYS_INLINE void for_each_vector(F&& f) {
  [&]<int... J>(std::integer_sequence<int, J...>) { (f(std::integral_constant<int, J>{}), ...); }(
      std::make_integer_sequence<int, N>{});
}

/// Query-head blocks whose kG·kVectors accumulators fit the registers of A with room to spare.
template <int kVectors, class A>
constexpr int kivi_max_heads() noexcept {
  constexpr int registers = std::is_same_v<A, xsimd::avx512bw> ? 16 : 8;
  constexpr int heads = registers / kVectors;
  return heads >= 8 ? 8 : heads >= 4 ? 4 : heads >= 2 ? 2 : 1;
}

/// Whether A takes kivi_vnni.hpp's integer dot products (both code widths).
template <class A>
inline constexpr bool kKiviVnni =
#if KVPACK_KERNELS_HAVE_VNNI
    std::is_same_v<A, xsimd::avx512bw>;
#else
    false;
#endif

/// Whether A's value sums for Bits-bit codes split each channel over two lanes (2-bit VNNI:
/// four vectors per 32 channels, put back in order once per call).
template <int Bits, class A>
inline constexpr bool kKiviSplitValueLanes = kKiviVnni<A> && Bits == 2;

/// The integer kernels of A, both widths with the same operands: kivi_vnni.hpp's on AVX-512 with
/// VNNI, kivi_avx2.hpp's on AVX2 (KVQuant's keys take them too, with ByteLevels as the operand).
/// A call scores 32 tokens of one key group for up to kKeyHeads heads, or sums one page for 32
/// channels of one value group for up to kValueHeads heads, in key_steps / value_steps
/// prefetch steps.
template <class A>
struct KiviIntegerKernels {
  static constexpr bool kAvailable = false;
  struct ByteLevels {  // never used: lets callers name the type on every target
    explicit ByteLevels(const float (&)[16]) noexcept {}
    float step = 0.0f;
  };
  static constexpr index_t key_steps(int, index_t) noexcept { return 1; }
  static constexpr index_t value_steps(int, index_t) noexcept { return 1; }
};

#if KVPACK_KERNELS_HAVE_VNNI
template <>
struct KiviIntegerKernels<xsimd::avx512bw> {
  static constexpr bool kAvailable = true;
  using ByteLevels = cpu::ByteLevels;
  template <int Bits>
  static constexpr int kKeyHeads = 4;
  template <int Bits>
  static constexpr int kValueHeads = 4;
  static constexpr index_t key_steps(int bits, index_t head_dim) noexcept { return head_dim / (bits == 4 ? 4 : 8); }
  static constexpr index_t value_steps(int bits, index_t page_size) noexcept { return page_size / (bits == 4 ? 4 : 8); }

  template <class... Args>
  static KVPACK_ALWAYS_INLINE bool fold_query(Args... args) noexcept {
    return kivi_vnni::fold_query(xsimd::avx512bw{}, args...);
  }
  /// With fp32 scales and minimums (KVQuant's calibrated ranges and offsets).
  static KVPACK_ALWAYS_INLINE bool fold_query(const float* queries, index_t group, index_t head_dim,
                                              const float* scales, const float* mins, float* folded,
                                              std::int16_t* q16, float* step, float* bias) noexcept {
    return kivi_vnni::fold_query(
        queries, group, head_dim, [&](index_t c) { return _mm512_loadu_ps(scales + c); },
        [&](index_t c) { return _mm512_loadu_ps(mins + c); }, folded, q16, step, bias);
  }
  template <int Bits, int kG, class... Args>
  static KVPACK_ALWAYS_INLINE void score(Args&&... args) noexcept {
    if constexpr (Bits == 4) {
      kivi_vnni::score_tokens<kG>(args...);
    } else {
      kivi_vnni::score_tokens_2bit<kG>(args...);
    }
  }
  template <class... Args>
  static KVPACK_ALWAYS_INLINE void quantize_weights(Args... args) noexcept {
    kivi_vnni::quantize_group_weights(xsimd::avx512bw{}, args...);
  }
  template <int Bits, int kG, class... Args>
  static KVPACK_ALWAYS_INLINE void accumulate(Args&&... args) noexcept {
    if constexpr (Bits == 4) {
      kivi_vnni::accumulate_channels<kG>(args...);
    } else {
      kivi_vnni::accumulate_channels_2bit<kG>(args...);
    }
  }  /// KVQuant's 3-bit pages as 4-bit codes (`chunks` runs of 32 codes, a multiple of 4).
  static KVPACK_ALWAYS_INLINE void widen_3bit_codes(const std::uint8_t* in, std::size_t chunks,
                                                    std::uint8_t* out) noexcept {
    cpu::widen_3bit_codes(in, chunks, out);
  }
};
#endif

#if KVPACK_KERNELS_HAVE_AVX2_INTEGER
template <>
struct KiviIntegerKernels<avx2_arch> {
  static constexpr bool kAvailable = true;
  using ByteLevels = kivi_avx2::ByteLevels;
  template <int Bits>
  static constexpr int kKeyHeads = Bits == 4 ? 4 : 2;
  template <int Bits>
  static constexpr int kValueHeads = 2;
  static constexpr index_t key_steps(int bits, index_t head_dim) noexcept { return head_dim / (bits == 4 ? 2 : 8); }
  static constexpr index_t value_steps(int, index_t page_size) noexcept { return page_size / 8; }

  template <class... Args>
  static KVPACK_ALWAYS_INLINE bool fold_query(Args... args) noexcept {
    return kivi_avx2::fold_query(avx2_arch{}, args...);
  }
  template <int Bits, int kG, class... Args>
  static KVPACK_ALWAYS_INLINE void score(Args&&... args) noexcept {
    if constexpr (Bits == 4) {
      kivi_avx2::score_tokens<kG>(args...);
    } else {
      kivi_avx2::score_tokens_2bit<kG>(args...);
    }
  }
  template <class... Args>
  static KVPACK_ALWAYS_INLINE void quantize_weights(Args... args) noexcept {
    kivi_avx2::quantize_group_weights(avx2_arch{}, args...);
  }
  template <int Bits, int kG, class... Args>
  static KVPACK_ALWAYS_INLINE void accumulate(Args&&... args) noexcept {
    if constexpr (Bits == 4) {
      kivi_avx2::accumulate_channels<kG>(args...);
    } else {
      kivi_avx2::accumulate_channels_2bit<kG>(args...);
    }
  }  /// KVQuant's 3-bit pages as 4-bit codes (`chunks` runs of 32 codes, even).
  static KVPACK_ALWAYS_INLINE void widen_3bit_codes(const std::uint8_t* in, std::size_t chunks,
                                                    std::uint8_t* out) noexcept {
    kivi_avx2::widen_3bit_codes(in, chunks, out);
  }
};
#endif

/// Each head's largest weight on a page (weights are exp(·) ≥ 0): what the integer value paths
/// scale their int8 weights by.
template <class A>
KVPACK_ALWAYS_INLINE void page_head_max(const float* weights, index_t weight_stride, index_t group,
                                        index_t page_size, float* head_max) noexcept {
  using batch = simd::f32<A>;
  for (index_t h = 0; h < group; ++h) {
    batch largest(0.0f);
    for (index_t t = 0; t < page_size; t += static_cast<index_t>(batch::size)) {
      largest = xsimd::max(largest, batch::load_unaligned(weights + h * weight_stride + t));
    }
#if KVPACK_KERNELS_HAVE_VNNI
    if constexpr (std::is_same_v<A, xsimd::avx512bw>) {
      head_max[h] = _mm512_reduce_max_ps(largest);
      continue;
    }
#endif
    head_max[h] = simd::reduce_max<A>(largest);
  }
}

/// A per-token plane (values, or the ablation's keys) as fp32, token-major (`tile[t·head_dim + c]`).
template <int Bits, int Group, Plane kPlane, class A>
KVPACK_ALWAYS_INLINE void unpack_kivi_tokens(A, quant::PageGeometry g, const std::byte* plane, float* tile) noexcept {
  using Codec = quant::KiviTokenCodec<Bits, Group, kPlane>;
  const std::size_t groups = static_cast<std::size_t>(g.head_dim / Group);  // scale[token][group]
  for (index_t t = 0; t < g.page_size; ++t) {
    unpack_kivi_row<Bits, A>(plane + Codec::row_bytes(g) * static_cast<std::size_t>(t), g.head_dim, Group,
                             plane + Codec::scales_offset(g) + 2 * groups * static_cast<std::size_t>(t),
                             plane + Codec::mins_offset(g) + 2 * groups * static_cast<std::size_t>(t), 2,
                             tile + static_cast<std::size_t>(t) * g.head_dim);
  }
}

/// Per head, the query times the channel scales of token group `tg` (qs[h][c] = q_c·s_c) and
/// the query times its minimums (bias[h] = Σ_c q_c·m_c).
template <int Bits, int Group, class A>
KVPACK_ALWAYS_INLINE void fold_key_group(const std::byte* plane, quant::PageGeometry g, index_t tg,
                                         const float* queries, index_t group, float* qs, float* bias) noexcept {
  using Codec = quant::KiviKeyCodec<Bits, Group>;
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  const index_t d = g.head_dim;
  const std::size_t meta = static_cast<std::size_t>(tg) * d * 2;  // scale[group][channel]
  const auto* scales = reinterpret_cast<const std::uint16_t*>(plane + Codec::scales_offset(g) + meta);
  const auto* mins = reinterpret_cast<const std::uint16_t*>(plane + Codec::mins_offset(g) + meta);
  const index_t vector_end = d - d % kWidth;
  for (index_t h = 0; h < group; ++h) {
    const float* q = queries + h * d;
    batch dot(0.0f);
    for (index_t c = 0; c < vector_end; c += kWidth) {
      const batch qc = batch::load_unaligned(q + c);
      (qc * simd::load_f16<A>(scales + c)).store_unaligned(qs + h * d + c);
      dot = xsimd::fma(qc, simd::load_f16<A>(mins + c), dot);
    }
    float sum = simd::reduce_sum<A>(dot);
    for (index_t c = vector_end; c < d; ++c) {
      qs[h * d + c] = q[c] * static_cast<float>(half::from_bits(scales[c]));
      sum += q[c] * static_cast<float>(half::from_bits(mins[c]));
    }
    bias[h] = sum;
  }
}

/// Scores of kG heads for the Group tokens of one token group, from the codes at `codes`
/// (channel c's codes row_bytes·c further on): Σ_c qs_c·code_tc + bias, written in token order.
template <int Bits, int Group, int kG, class A>
KVPACK_ALWAYS_INLINE void score_kivi_token_group(const std::uint8_t* codes, std::size_t row_bytes, index_t head_dim,
                                                 const float* qs, const float* bias, float* scores,
                                                 index_t stride) noexcept {
  using L = KiviLanes<Bits, Group, A>;
  using batch = simd::f32<A>;
  for (index_t chunk = 0; chunk < L::kChunks; ++chunk) {
    batch acc[kG][L::kVectors];
    for (int h = 0; h < kG; ++h) {
      for (int j = 0; j < L::kVectors; ++j) acc[h][j] = batch(0.0f);
    }
    const std::uint8_t* p = codes + chunk * L::kChunkBytes;
    for (index_t c = 0; c < head_dim; ++c, p += row_bytes) {
      const simd::i32<A> packed = L::load(p);
      for_each_vector<L::kVectors>([&](auto j) {
        const batch k = L::template codes<decltype(j)::value>(packed);
        KVPACK_UNROLL
        for (int h = 0; h < kG; ++h) acc[h][j] = xsimd::fma(batch(qs[h * head_dim + c]), k, acc[h][j]);
      });
    }
    alignas(64) float lanes[L::kWidth];
    for (int h = 0; h < kG; ++h) {
      float* out = scores + h * stride + chunk * L::kChunkElements;
      for (int j = 0; j < L::kVectors; ++j) {
        (acc[h][j] + batch(bias[h])).store_aligned(lanes);
        for (index_t l = 0; l < L::kWidth; ++l) out[L::element(j, l)] = lanes[l];
      }
    }
  }
}

template <int Bits, int Group, class A>
void score_keys(A, std::type_identity<quant::KiviKeyCodec<Bits, Group>>,
                const ScoreArgs<quant::NoParams>& args) noexcept {
  using Codec = quant::KiviKeyCodec<Bits, Group>;
  using L = KiviLanes<Bits, Group, A>;
  const PageRun& run = args.run;
  const index_t d = run.head_dim;
  const quant::PageGeometry geometry{run.page_size, d};
  const std::size_t row_bytes = Codec::row_bytes(geometry);
  float* qs = args.scratch;                                     // [group][head_dim]
  // [group], then (integer path) the int16 steps [group], the int16 query [group][head_dim] and
  // the token group's scales and minimums as fp32 [2][head_dim].
  float* bias = qs + static_cast<std::size_t>(args.group) * d;
  using Integer = KiviIntegerKernels<A>;
  for (index_t i = 0; i < run.count; ++i) {
    // Spread over the integer score loop where it runs.
    PagePrefetcher prefetcher(run, i, 1, Integer::kAvailable ? run.page_size / 32 * Integer::key_steps(Bits, d) : 1);
    if constexpr (!Integer::kAvailable) prefetcher.step();
    const std::byte* plane = run.pages[i];
    float* scores = args.scores + i * run.page_size;
    for (index_t tg = 0; tg < run.page_size / Group; ++tg) {
      const auto* codes = reinterpret_cast<const std::uint8_t*>(plane) + tg * L::kGroupBytes;
      if constexpr (Integer::kAvailable) {
        const std::size_t meta = static_cast<std::size_t>(tg) * d * 2;
        auto* q16 = reinterpret_cast<std::int16_t*>(bias + 2 * args.group);  // [group][head_dim]
        float* converted = reinterpret_cast<float*>(q16 + static_cast<std::size_t>(args.group) * d);
        if (d % 16 == 0 &&  // whole vectors of channels
            Integer::fold_query(
                args.queries, args.group, d,
                reinterpret_cast<const std::uint16_t*>(plane + Codec::scales_offset(geometry) + meta),
                reinterpret_cast<const std::uint16_t*>(plane + Codec::mins_offset(geometry) + meta), converted, qs,
                q16, bias + args.group, bias)) {
          for (index_t k = 0; k < Group / 32; ++k) {  // 32 tokens, 4·Bits bytes of each channel's row
            for_each_head_block<Integer::template kKeyHeads<Bits>>(args.group, [&](auto block, index_t h0) {
              float* out = scores + h0 * args.score_stride + tg * Group + 32 * k;
              Integer::template score<Bits, decltype(block)::value>(codes + 4 * Bits * k, row_bytes, d, q16 + h0 * d,
                                                                    bias + args.group + h0, bias + h0, out,
                                                                    args.score_stride, prefetcher);
            });
          }
          continue;
        }
        prefetcher.finish();  // the fp32 path below takes no steps
      }
      fold_key_group<Bits, Group, A>(plane, geometry, tg, args.queries, args.group, qs, bias);
      for_each_head_block<kivi_max_heads<L::kVectors, A>()>(args.group, [&](auto block, index_t h0) {
        score_kivi_token_group<Bits, Group, decltype(block)::value, A>(
            codes, row_bytes, d, qs + h0 * d, bias + h0, scores + h0 * args.score_stride + tg * Group,
            args.score_stride);
      });
    }
    if (run.live != nullptr) mask_dead_slots(run.live[i], run.page_size, args.group, scores, args.score_stride);
  }
}

/// The ablation's per-token keys: token-major rows, scored like the tail's full-precision rows
/// (with the query permuted into the rows' channel order when they are sliced).
template <int Bits, int Group, class A>
void score_keys(A arch, std::type_identity<quant::KiviTokenCodec<Bits, Group, Plane::kKey>>,
                const ScoreArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const index_t d = run.head_dim;
  const quant::PageGeometry geometry{run.page_size, d};
  float* tile = args.scratch;  // [page_size][head_dim]
  const float* queries = args.queries;
  if (slices_fit<Bits, A>(d, Group)) {
    float* sliced_queries = tile + static_cast<std::size_t>(run.page_size) * d;  // [group][head_dim]
    for (index_t h = 0; h < args.group; ++h) {
      for (index_t c = 0; c < d; ++c) sliced_queries[h * d + sliced_position<Bits>(c, d)] = args.queries[h * d + c];
    }
    queries = sliced_queries;
  }
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher(run, i, 1, 1).step();
    unpack_kivi_tokens<Bits, Group, Plane::kKey>(arch, geometry, run.pages[i], tile);
    score_rows(arch, RowScoreArgs{tile, run.page_size, d, d, queries, args.group, args.scores + i * run.page_size,
                                  args.score_stride});
    if (run.live != nullptr) {
      mask_dead_slots(run.live[i], run.page_size, args.group, args.scores + i * run.page_size, args.score_stride);
    }
  }
}

/// A value page's fp16 scales and minimums, [rows][groups] with rows = 2·page_size (every token's
/// scales, then every token's minimums), as fp32 [groups][rows]: a channel group's values for a
/// run of tokens become one contiguous load. AVX-512 and AVX2 transpose groups of 2 and 4 in
/// registers (faster than the gathers they replace); other cases convert into `staging`
/// (rows·groups floats) and transpose after.
template <class A>
KVPACK_ALWAYS_INLINE void value_metadata_by_group(const std::uint16_t* metadata, index_t rows, index_t groups,
                                                  float* staging, float* by_group) noexcept {
  constexpr std::size_t kWidth = simd::f32<A>::size;
  if (groups == 1) {  // [rows][1] is [1][rows]
    for (index_t r = 0; r < rows; r += kWidth) simd::load_f16<A>(metadata + r).store_unaligned(by_group + r);
    return;
  }
#if XSIMD_WITH_AVX512BW
  if constexpr (std::is_same_v<A, xsimd::avx512bw>) {
    if (groups == 2 || groups == 4) {
      // Sixteen rows are one or two registers of halves, and one word permute takes out two
      // groups' sixteen values: vgatherdps per group and 16 rows cost 20 % of KIVI-2's value
      // kernel on Zen 5, most likely by loading from the conversion's stores still in flight.
      // Word l of pick[pair]: row l % 16, group 2·pair + l / 16.
      const __m512i row = _mm512_set_epi16(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0,  //
                                           15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
      const __m512i first_of_row = _mm512_mullo_epi16(row, _mm512_set1_epi16(static_cast<short>(groups)));
      const __m512i upper_half = _mm512_maskz_set1_epi16(0xFFFF0000u, 1);
      const __m512i pick[2] = {_mm512_add_epi16(first_of_row, upper_half),
                               _mm512_add_epi16(first_of_row, _mm512_add_epi16(upper_half, _mm512_set1_epi16(2)))};
      for (index_t r = 0; r < rows; r += 16) {
        const std::uint16_t* at = metadata + r * groups;
        const __m512i low = _mm512_loadu_si512(at);
        const __m512i high = groups == 4 ? _mm512_loadu_si512(at + 32) : low;
        for (index_t pair = 0; pair < groups / 2; ++pair) {
          const __m512i two = _mm512_permutex2var_epi16(low, pick[pair], high);
          _mm512_storeu_ps(by_group + 2 * pair * rows + r, _mm512_cvtph_ps(_mm512_castsi512_si256(two)));
          _mm512_storeu_ps(by_group + (2 * pair + 1) * rows + r, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(two, 1)));
        }
      }
      return;
    }
  }
#endif
#if XSIMD_WITH_AVX2
  if constexpr (std::is_same_v<A, xsimd::fma3<xsimd::avx2>>) {
    auto halves = [&](index_t at) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(metadata + at)));
    };
    if (groups == 2) {  // four rows per register: even lanes group 0, odd lanes group 1
      for (index_t r = 0; r < rows; r += 8) {
        const __m256 a = halves(r * 2), b = halves(r * 2 + 8);
        // Per 128-bit lane [a0, a2, b0, b2]: rows 0, 1, 4, 5 | 2, 3, 6, 7; the 64-bit permute orders them.
        const __m256 even = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
        const __m256 odd = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
        auto in_order = [](__m256 x) {
          return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), _MM_SHUFFLE(3, 1, 2, 0)));
        };
        _mm256_storeu_ps(by_group + r, in_order(even));
        _mm256_storeu_ps(by_group + rows + r, in_order(odd));
      }
      return;
    }
    if (groups == 4) {  // two rows per register
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      for (index_t r = 0; r < rows; r += 8) {
        const __m256 v0 = halves(r * 4), v1 = halves(r * 4 + 8), v2 = halves(r * 4 + 16), v3 = halves(r * 4 + 24);
        // A 4×4 transpose inside each 128-bit lane leaves group g's rows as 0, 2, 4, 6 | 1, 3, 5, 7.
        const __m256d t0 = _mm256_castps_pd(_mm256_unpacklo_ps(v0, v1));
        const __m256d t1 = _mm256_castps_pd(_mm256_unpackhi_ps(v0, v1));
        const __m256d t2 = _mm256_castps_pd(_mm256_unpacklo_ps(v2, v3));
        const __m256d t3 = _mm256_castps_pd(_mm256_unpackhi_ps(v2, v3));
        const __m256d by_lane[4] = {_mm256_unpacklo_pd(t0, t2), _mm256_unpackhi_pd(t0, t2), _mm256_unpacklo_pd(t1, t3),
                                    _mm256_unpackhi_pd(t1, t3)};
        for (index_t g = 0; g < 4; ++g) {
          _mm256_storeu_ps(by_group + g * rows + r, _mm256_permutevar8x32_ps(_mm256_castpd_ps(by_lane[g]), order));
        }
      }
      return;
    }
  }
#endif
  const std::size_t count = static_cast<std::size_t>(rows) * groups;  // rows is a multiple of 32
  for (std::size_t k = 0; k < count; k += kWidth) simd::load_f16<A>(metadata + k).store_unaligned(staging + k);
  for (index_t g = 0; g < groups; ++g) {
    for (index_t r = 0; r < rows; ++r) by_group[g * rows + r] = staging[r * groups + g];
  }
}

/// Where the fused value kernel keeps its state in the call's scratch.
struct KiviValueScratch {
  float* sums;       ///< [group][head_dim·(2 for 2-bit VNNI)]: Σ_t (w_t·s_t)·code_tc, in lane order
  float* min_sums;   ///< [group][head_dim / Group][W]: Σ_t w_t·m_t, in W partial sums
  float* scaled;     ///< [group][page_size]: w_t·s_t of one channel group (the fp32 path)
  float* staging;    ///< [2·page_size][head_dim / Group]: the page's scales, then minimums
  float* by_group;   ///< [head_dim / Group][2·page_size]: the same by channel group (value_metadata_by_group)
  // The integer paths:
  std::int8_t* scaled_int8;  ///< [group][page_size]: w_t·s_t of one channel group as int8
  float* steps;              ///< [group]: their steps
  float* head_max;           ///< [group]: each head's largest weight on the page
};

/// Sums of kG heads over one page for one chunk of one channel group, from the codes at `codes`
/// (token t's row_bytes·t further on): sums[h][lane order] += Σ_t scaled[h][t]·code_tc.
template <int Bits, int Group, int kG, class A>
KVPACK_ALWAYS_INLINE void accumulate_kivi_chunk(const std::uint8_t* codes, std::size_t row_bytes, index_t page_size,
                                                const float* scaled, float* sums, index_t head_dim) noexcept {
  using L = KiviLanes<Bits, Group, A>;
  using batch = simd::f32<A>;
  batch acc[kG][L::kVectors];
  for (int h = 0; h < kG; ++h) {
    for (int j = 0; j < L::kVectors; ++j) acc[h][j] = batch(0.0f);
  }
  const std::uint8_t* p = codes;
  for (index_t t = 0; t < page_size; ++t, p += row_bytes) {
    const simd::i32<A> packed = L::load(p);
    for_each_vector<L::kVectors>([&](auto j) {
      const batch v = L::template codes<decltype(j)::value>(packed);
      KVPACK_UNROLL
      for (int h = 0; h < kG; ++h) acc[h][j] = xsimd::fma(batch(scaled[h * page_size + t]), v, acc[h][j]);
    });
  }
  for (int h = 0; h < kG; ++h) {
    for (int j = 0; j < L::kVectors; ++j) {
      float* out = sums + h * head_dim + j * L::kWidth;
      (batch::load_unaligned(out) + acc[h][j]).store_unaligned(out);
    }
  }
}

/// acc[c] += one head's value sums (`sums`, in the value kernel's lane order).
template <int Bits, int Group, class A>
KVPACK_ALWAYS_INLINE void add_value_sums_in_order(const float* sums, index_t head_dim, float* acc) noexcept {
#if KVPACK_KERNELS_HAVE_VNNI
  if constexpr (kKiviSplitValueLanes<Bits, A>) {
    for (index_t c = 0; c < head_dim; c += 32) {
      const float* in = sums + 2 * c;
      const __m512 lanes[4] = {_mm512_loadu_ps(in), _mm512_loadu_ps(in + 16), _mm512_loadu_ps(in + 32),
                               _mm512_loadu_ps(in + 48)};
      __m512 first, second;
      kivi_vnni::lane_pairs_in_order(lanes, first, second);
      _mm512_storeu_ps(acc + c, _mm512_add_ps(_mm512_loadu_ps(acc + c), first));
      _mm512_storeu_ps(acc + c + 16, _mm512_add_ps(_mm512_loadu_ps(acc + c + 16), second));
    }
    return;
  }
#endif
  using L = KiviLanes<Bits, Group, A>;
#if XSIMD_WITH_AVX512BW
  if constexpr (std::is_same_v<A, xsimd::avx512bw> && L::kChunkElements == 32 && L::element(0, 1) == 2 &&
                L::element(1, 0) == 1) {
    // Chunks of 32 with the even elements in the first vector and the odd ones in the second (4-bit
    // codes): one interleave per 16 elements. The scalar loop below took ~8 % of the value kernel.
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (index_t c = 0; c < head_dim; c += 32) {
      const __m512 even = _mm512_loadu_ps(sums + c), odd = _mm512_loadu_ps(sums + c + 16);
      _mm512_storeu_ps(acc + c, _mm512_add_ps(_mm512_loadu_ps(acc + c), _mm512_permutex2var_ps(even, first, odd)));
      _mm512_storeu_ps(acc + c + 16,
                       _mm512_add_ps(_mm512_loadu_ps(acc + c + 16), _mm512_permutex2var_ps(even, second, odd)));
    }
    return;
  }
#endif
  for (index_t chunk = 0; chunk < head_dim / L::kChunkElements; ++chunk) {
    const float* in = sums + chunk * L::kChunkElements;
    float* out = acc + chunk * L::kChunkElements;
    for (int j = 0; j < L::kVectors; ++j) {
      for (index_t l = 0; l < L::kWidth; ++l) out[L::element(j, l)] += in[j * L::kWidth + l];
    }
  }
}

template <int Bits, int Group, class A>
void accumulate_values(A, std::type_identity<quant::KiviValueCodec<Bits, Group>>,
                       const AccumulateArgs<quant::NoParams>& args) noexcept {
  using Codec = quant::KiviValueCodec<Bits, Group>;
  using L = KiviLanes<Bits, Group, A>;
  using batch = simd::f32<A>;
  constexpr index_t kWidth = L::kWidth;
  const PageRun& run = args.run;
  const index_t d = run.head_dim, page = run.page_size, groups = d / Group;
  const quant::PageGeometry geometry{page, d};
  const std::size_t row_bytes = Codec::row_bytes(geometry);
  const std::size_t metas = static_cast<std::size_t>(page) * groups;
  const index_t sums_stride = kKiviSplitValueLanes<Bits, A> ? 2 * d : d;
  KiviValueScratch s{};
  s.sums = args.scratch;
  s.min_sums = s.sums + static_cast<std::size_t>(args.group) * sums_stride;
  s.scaled = s.min_sums + static_cast<std::size_t>(args.group) * groups * kWidth;
  s.staging = s.scaled + static_cast<std::size_t>(args.group) * page;
  s.by_group = s.staging + 2 * metas;
  s.steps = s.by_group + 2 * metas;
  s.head_max = s.steps + args.group;
  s.scaled_int8 = reinterpret_cast<std::int8_t*>(s.head_max + args.group);
  std::fill(s.sums, s.scaled, 0.0f);
  using Integer = KiviIntegerKernels<A>;
  // The integer kernels step through whole vectors of 16 tokens (every cache's pages).
  const bool integer = Integer::kAvailable && page % 16 == 0;
  for (index_t i = 0; i < run.count; ++i) {
    // The value planes ahead (kValueKernelPrefetches), spread over the integer loop where it runs.
    PagePrefetcher prefetcher(run, i, 1, integer ? d / 32 * Integer::value_steps(Bits, page) : 1, Plane::kValue);
    if (!integer) prefetcher.step();
    const std::byte* plane = run.pages[i] + run.value_offset;
    // Scales and minimums are [token][channel group] fp16, contiguous; the products take them a
    // channel group at a time.
    const auto* metadata = reinterpret_cast<const std::uint16_t*>(plane + Codec::scales_offset(geometry));
    value_metadata_by_group<A>(metadata, 2 * page, groups, s.staging, s.by_group);
    const float* weights = args.weights + i * page;
    if constexpr (Integer::kAvailable) {
      if (integer) {
        page_head_max<A>(weights, args.weight_stride, args.group, page, s.head_max);
        for (index_t gc = 0; gc < groups; ++gc) {
          const float* group_meta = s.by_group + 2 * gc * page;  // scales, then minimums
          Integer::quantize_weights(weights, args.weight_stride, args.group, page, group_meta, group_meta + page,
                                    s.head_max, s.min_sums + gc * kWidth, groups * kWidth, s.scaled_int8, s.steps);
          const auto* codes = reinterpret_cast<const std::uint8_t*>(plane) + gc * L::kGroupBytes;
          for (index_t k = 0; k < Group / 32; ++k) {  // 32 channels, 4·Bits bytes of each token's row
            for_each_head_block<Integer::template kValueHeads<Bits>>(args.group, [&](auto block, index_t h0) {
              const std::int8_t* w8 = s.scaled_int8 + static_cast<std::size_t>(h0) * page;
              // KiviLanes<Bits, Group, A>'s order, or lane_pairs_in_order's (kKiviSplitValueLanes).
              float* out = s.sums + h0 * sums_stride + (gc * Group + 32 * k) * (sums_stride / d);
              Integer::template accumulate<Bits, decltype(block)::value>(codes + 4 * Bits * k, row_bytes, page, w8,
                                                                         s.steps + h0, out, sums_stride, prefetcher);
            });
          }
        }
        continue;
      }
    }
    for (index_t gc = 0; gc < groups; ++gc) {
      for (index_t t = 0; t < page; t += kWidth) {
        const batch scale = batch::load_unaligned(s.by_group + 2 * gc * page + t);
        const batch min = batch::load_unaligned(s.by_group + (2 * gc + 1) * page + t);
        for (index_t h = 0; h < args.group; ++h) {
          const batch wt = batch::load_unaligned(weights + h * args.weight_stride + t);
          (wt * scale).store_unaligned(s.scaled + h * page + t);
          float* min_sum = s.min_sums + (h * groups + gc) * kWidth;
          xsimd::fma(wt, min, batch::load_unaligned(min_sum)).store_unaligned(min_sum);
        }
      }
      const auto* codes = reinterpret_cast<const std::uint8_t*>(plane) + gc * L::kGroupBytes;
      for (index_t chunk = 0; chunk < L::kChunks; ++chunk) {
        for_each_head_block<kivi_max_heads<L::kVectors, A>()>(args.group, [&](auto block, index_t h0) {
          accumulate_kivi_chunk<Bits, Group, decltype(block)::value, A>(
              codes + chunk * L::kChunkBytes, row_bytes, page, s.scaled + h0 * page,
              s.sums + h0 * d + (gc * L::kChunks + chunk) * L::kChunkElements, d);
        });
      }
    }
  }
  // Back to channel order, with each channel group's Σ w·m.
  for (index_t h = 0; h < args.group; ++h) {
    add_value_sums_in_order<Bits, Group, A>(s.sums + h * sums_stride, d, args.acc + h * d);
    for (index_t gc = 0; gc < groups; ++gc) {
      const batch min_sum(simd::reduce_sum<A>(batch::load_unaligned(s.min_sums + (h * groups + gc) * kWidth)));
      for (index_t c = gc * Group; c < (gc + 1) * Group; c += kWidth) {  // Group is a multiple of 32
        float* out = args.acc + h * d + c;
        (batch::load_unaligned(out) + min_sum).store_unaligned(out);
      }
    }
  }
}

}  // namespace kvpack::inline v0::kernels::cpu
