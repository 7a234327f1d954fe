#pragma once
/// \file mma_tiles.cuh
/// \brief fp16 and q4_0 page bytes loaded straight into tensor-core operands (mma.m16n8k16,
///        fp16 inputs, fp32 sums): what the attention kernel of mma_attention.cuh multiplies.
///
/// A warp works on 32 tokens of a page at a time, a *chunk*. Scores are Sᵀ = Qᵀ·Kᵀ (rows: query
/// heads, columns: tokens, summed over channels); the output is Oᵀ += Vᵀ·Pᵀ (rows: channels,
/// columns: query heads, summed over tokens). The order of a summed dimension is free as long as
/// both operands use the same one, and rows and columns may be permuted as long as the kernel
/// knows where each result lands. Each codec below picks the orders in which its page bytes load
/// with 8- or 16-byte loads and become fp16 pairs with one byte permute or one mask:
/// - lane l of the warp is thread (g = l / 4, k = l % 4) of the mma fragment layout;
/// - after scoring, thread (g, k) holds head g's scores of tokens 8k … 8k+7 of the chunk, and the
///   value product takes exactly those tokens' weights from it, so no weight moves between lanes;
/// - the output rows thread (g, k) accumulates are the channels `value_channel(d, g, m, upper)`.
///
/// Precision. The query and the weights are fp32; each is split into two fp16 parts (hi + lo,
/// together 22 significant bits) after scaling by a power of two that keeps both parts out of
/// fp16's subnormal range. fp16 elements and q4_0 codes are exact in fp16, products of fp16 are
/// exact, and the tensor cores sum in fp32: the results stay within the fp32 bound the generic
/// kernel meets (tests/support/error_bound.hpp).

#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "kvpack/config.hpp"
#include "kvpack/core/half.hpp"
#include "kvpack/kernels/cuda/element_decode.hpp"
#include "kvpack/kernels/cuda/warp_reduce.cuh"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::kernels::cuda {

namespace mma_detail {

/// d += a·b for one m16n8k16 tile (fp16 operands, fp32 accumulators).
__device__ __forceinline__ void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// An fp32 pair as two fp16 pairs whose sum is the pair to 22 bits (x in the low half).
struct SplitPair {
  std::uint32_t hi = 0, lo = 0;
};
__device__ __forceinline__ SplitPair split(float x, float y) {
  const __half2 hi = __floats2half2_rn(x, y);
  const float2 back = __half22float2(hi);
  const __half2 lo = __floats2half2_rn(x - back.x, y - back.y);
  return {*reinterpret_cast<const std::uint32_t*>(&hi), *reinterpret_cast<const std::uint32_t*>(&lo)};
}

/// 2^e with e chosen so that largest·2^e lies in [2^14, 2^15): fp16 holds it and its residual
/// without underflow. 1 when largest is zero, subnormal-small beyond 2^-100, or not finite.
__device__ __forceinline__ float fp16_range_scale(float largest) {
  if (!(largest > 0.0f) || !isfinite(largest)) return 1.0f;
  const int e = min(100, max(-100, 14 - ilogbf(largest)));
  return ldexpf(1.0f, e);
}

/// Bits 0–3 and 16–19 of `word >> shift` as the fp16 pair (code − 8): or-ing a nibble n into the
/// mantissa of 1024.0 gives 1024 + n exactly, and subtracting 1032 leaves n − 8, also exact.
__device__ __forceinline__ std::uint32_t nibble_pair(std::uint32_t word, int shift) {
  const std::uint32_t biased = ((word >> shift) & 0x000F000Fu) | 0x64006400u;
  const __half2 value = __hsub2(*reinterpret_cast<const __half2*>(&biased), __half2half2(__ushort_as_half(0x6408)));
  return *reinterpret_cast<const std::uint32_t*>(&value);
}

/// The fp16 pair (low half of x, low half of y) or (high half of x, high half of y).
__device__ __forceinline__ std::uint32_t low_halves(std::uint32_t x, std::uint32_t y) { return __byte_perm(x, y, 0x5410); }
__device__ __forceinline__ std::uint32_t high_halves(std::uint32_t x, std::uint32_t y) { return __byte_perm(x, y, 0x7632); }

}  // namespace mma_detail

/// The query of one head pass as the A operand of the score product, in fp16 hi and lo parts:
/// [k-tile][0: a0a1, 1: a4a5]. Rows 8–15 of the tile (a2a3, a6a7) are zero.
template <int KTiles>
struct QueryFragments {
  std::uint32_t hi[KTiles][2];
  std::uint32_t lo[KTiles][2];
  float unscale = 1.0f;  ///< 2^-e: scores come out multiplied by the scale the query was given
};

/// Key planes as the B operand of the score product, per codec. `channel(kt, slot)` is the
/// channel a k-slot (0–15) of k-tile kt stands for. `fetch` issues every load of a chunk at once
/// (one memory round trip, not one per tile) into a `Chunk` of registers; `score` then adds head
/// g's scores of tokens 8k … 8k+7 to s (still multiplied by the query's scale).
template <class Codec>
struct MmaKeys {
  static constexpr bool kSupported = false;
};

/// Value planes as the A operand of the output product, per codec: `value_channel(d, g, m, upper)`
/// is the channel of row g (+8 when upper) of m-tile m; `fetch` loads a chunk as for keys, and
/// `accumulate` adds Vᵀ·Pᵀ of the chunk to acc, in units of `unscale()`.
template <class Codec>
struct MmaValues {
  static constexpr bool kSupported = false;
};

/// fp16 keys, channel-major: a channel's 32 tokens are 64 consecutive bytes. Thread (g, k)
/// loads tokens 4g … 4g+3 of its four channels per k-tile (8 bytes each); n-tile j holds token
/// 4g + j of each, so the pair (channel, channel') of one token is one byte permute.
template <>
struct MmaKeys<quant::FloatCodec<half, Plane::kKey>> {
  static constexpr bool kSupported = true;
  KVPACK_HOST_DEVICE static constexpr int channel(int kt, int slot) { return 16 * kt + slot; }

  template <int KTiles>
  struct Chunk {
    uint2 rows[KTiles][4];  ///< channels 2k, 2k+1, 2k+8, 2k+9 of each k-tile, tokens 4g … 4g+3
  };

  template <int KTiles>
  __device__ static Chunk<KTiles> fetch(const std::byte* plane, quant::PageGeometry geometry, int chunk) {
    const int g = threadIdx.x % 32 / 4;
    const int k = threadIdx.x % 4;
    Chunk<KTiles> fetched;
#pragma unroll
    for (int kt = 0; kt < KTiles; ++kt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int slot = 2 * k + (i % 2) + (i / 2) * 8;
        const std::size_t element = static_cast<std::size_t>(channel(kt, slot)) * geometry.page_size + 32 * chunk + 4 * g;
        fetched.rows[kt][i] = decode_detail::load<uint2>(plane + element * 2);
      }
    }
    return fetched;
  }

  template <int KTiles>
  __device__ static void score(const Chunk<KTiles>& fetched, const QueryFragments<KTiles>& q, float (&s)[8]) {
    using namespace mma_detail;
    float c[4][4] = {};
#pragma unroll
    for (int kt = 0; kt < KTiles; ++kt) {
      const uint2 r0 = fetched.rows[kt][0], r1 = fetched.rows[kt][1], r8 = fetched.rows[kt][2], r9 = fetched.rows[kt][3];
      const std::uint32_t a_hi[4] = {q.hi[kt][0], 0u, q.hi[kt][1], 0u};
      const std::uint32_t a_lo[4] = {q.lo[kt][0], 0u, q.lo[kt][1], 0u};
      auto tile = [&](int j, std::uint32_t b0, std::uint32_t b1) {
        mma(c[j], a_hi, b0, b1);
        mma(c[j], a_lo, b0, b1);
      };
      tile(0, low_halves(r0.x, r1.x), low_halves(r8.x, r9.x));
      tile(1, high_halves(r0.x, r1.x), high_halves(r8.x, r9.x));
      tile(2, low_halves(r0.y, r1.y), low_halves(r8.y, r9.y));
      tile(3, high_halves(r0.y, r1.y), high_halves(r8.y, r9.y));
    }
    // Column 2k of n-tile j is token 4·2k + j, column 2k+1 is token 4·(2k+1) + j.
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      s[j] += c[j][0];
      s[4 + j] += c[j][1];
    }
  }
};

/// q4_0 keys: a 32-bit word holds 8 channels of one token (byte i: channel 4·quad+i of the
/// block's low half in its low nibble, of the high half in its high nibble), and a (block, quad)
/// row keeps tokens adjacent. Thread (g, k) loads quad k of tokens 4g … 4g+3 per block (16
/// bytes); the four nibble pairs of a word are the B operand of the block's two k-tiles. A block's
/// sums are taken alone and multiplied by each token's fp16 scale.
template <>
struct MmaKeys<quant::Q4_0Codec<Plane::kKey>> {
  using Codec = quant::Q4_0Codec<Plane::kKey>;
  static constexpr bool kSupported = true;
  /// Slot 2k / 2k+1 / 2k+8 / 2k+9 of k-tile 2b+h: channel 32b + 16h + 4k + 0 / 2 / 1 / 3.
  KVPACK_HOST_DEVICE static constexpr int channel(int kt, int slot) {
    return 32 * (kt / 2) + 16 * (kt % 2) + 4 * (slot % 8 / 2) + (slot % 2) * 2 + (slot >= 8 ? 1 : 0);
  }

  template <int KTiles>
  struct Chunk {
    uint4 words[KTiles / 2];   ///< per block: quad k of tokens 4g … 4g+3
    uint4 scales[KTiles / 2];  ///< per block: the fp16 scales of tokens 8k … 8k+7
  };

  template <int KTiles>
  __device__ static Chunk<KTiles> fetch(const std::byte* plane, quant::PageGeometry geometry, int chunk) {
    const int g = threadIdx.x % 32 / 4;
    const int k = threadIdx.x % 4;
    const std::byte* scales = plane + Codec::codes_bytes(geometry);
    Chunk<KTiles> fetched;
#pragma unroll
    for (int b = 0; b < KTiles / 2; ++b) {
      const std::size_t row = static_cast<std::size_t>(4 * b + k) * geometry.page_size + 32 * chunk + 4 * g;
      fetched.words[b] = decode_detail::load<uint4>(plane + row * 4);
      fetched.scales[b] =
          decode_detail::load<uint4>(scales + (static_cast<std::size_t>(b) * geometry.page_size + 32 * chunk + 8 * k) * 2);
    }
    return fetched;
  }

  template <int KTiles>
  __device__ static void score(const Chunk<KTiles>& fetched, const QueryFragments<KTiles>& q, float (&s)[8]) {
    using namespace mma_detail;
#pragma unroll
    for (int b = 0; b < KTiles / 2; ++b) {
      const std::uint32_t low_hi[4] = {q.hi[2 * b][0], 0u, q.hi[2 * b][1], 0u};
      const std::uint32_t low_lo[4] = {q.lo[2 * b][0], 0u, q.lo[2 * b][1], 0u};
      const std::uint32_t high_hi[4] = {q.hi[2 * b + 1][0], 0u, q.hi[2 * b + 1][1], 0u};
      const std::uint32_t high_lo[4] = {q.lo[2 * b + 1][0], 0u, q.lo[2 * b + 1][1], 0u};
      const uint4 words = fetched.words[b];
      const std::uint32_t word[4] = {words.x, words.y, words.z, words.w};
      float c[4][4] = {};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::uint32_t even_low = nibble_pair(word[j], 0), even_high = nibble_pair(word[j], 4);
        const std::uint32_t odd_low = nibble_pair(word[j], 8), odd_high = nibble_pair(word[j], 12);
        mma(c[j], low_hi, even_low, odd_low);
        mma(c[j], low_lo, even_low, odd_low);
        mma(c[j], high_hi, even_high, odd_high);
        mma(c[j], high_lo, even_high, odd_high);
      }
      const __half2* d = reinterpret_cast<const __half2*>(&fetched.scales[b]);  // tokens 8k … 8k+7
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        // Tokens 8k+2i, 8k+2i+1 (n-tiles 2i, 2i+1, column 2k) and 8k+4+2i, 8k+5+2i (column 2k+1).
        const float2 first = __half22float2(d[i]);
        const float2 second = __half22float2(d[2 + i]);
        s[2 * i] = fmaf(first.x, c[2 * i][0], s[2 * i]);
        s[2 * i + 1] = fmaf(first.y, c[2 * i + 1][0], s[2 * i + 1]);
        s[4 + 2 * i] = fmaf(second.x, c[2 * i][1], s[4 + 2 * i]);
        s[5 + 2 * i] = fmaf(second.y, c[2 * i + 1][1], s[5 + 2 * i]);
      }
    }
  }
};

/// fp16 values, token-major. Thread g owns the d/8 adjacent channels from (d/8)·g: word m of a
/// token's run is the channel pair of m-tile m (rows g and g+8), so the pair of two tokens for a
/// row is one byte permute. k-slots 2k, 2k+1, 2k+8, 2k+9 of k-tile kt are tokens
/// 8k + 4kt + 0, 1, 2, 3.
template <>
struct MmaValues<quant::FloatCodec<half, Plane::kValue>> {
  static constexpr bool kSupported = true;
  static constexpr float kWeightScale = 16384.0f;  ///< weights in (0, 1] scaled into fp16's normal range

  __device__ static int value_channel(index_t head_dim, int g, int m, bool upper) {
    return head_dim / 8 * g + 2 * m + (upper ? 1 : 0);
  }

  template <int MTiles>
  struct Chunk {
    std::uint32_t words[8][MTiles];  ///< tokens 8k … 8k+7, this thread's channel pairs
  };

  template <int MTiles>
  __device__ static Chunk<MTiles> fetch(const std::byte* plane, quant::PageGeometry geometry, int chunk) {
    const int g = threadIdx.x % 32 / 4;
    const int k = threadIdx.x % 4;
    Chunk<MTiles> fetched;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const std::byte* run =
          plane + (static_cast<std::size_t>(32 * chunk + 8 * k + i) * geometry.head_dim + 2 * MTiles * g) * 2;
#pragma unroll
      for (int m = 0; m < MTiles; m += 2) {
        const uint2 pair = decode_detail::load<uint2>(run + 4 * m);
        fetched.words[i][m] = pair.x;
        fetched.words[i][m + 1] = pair.y;
      }
    }
    return fetched;
  }

  template <int MTiles>
  __device__ static void accumulate(const Chunk<MTiles>& fetched, const float (&p)[8], float (&acc)[MTiles][4]) {
    using namespace mma_detail;
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) {
      const SplitPair b0 = split(p[4 * kt] * kWeightScale, p[4 * kt + 1] * kWeightScale);
      const SplitPair b1 = split(p[4 * kt + 2] * kWeightScale, p[4 * kt + 3] * kWeightScale);
      const auto& w = fetched.words;
      const int t = 4 * kt;
#pragma unroll
      for (int m = 0; m < MTiles; ++m) {
        const std::uint32_t a[4] = {low_halves(w[t][m], w[t + 1][m]), high_halves(w[t][m], w[t + 1][m]),
                                    low_halves(w[t + 2][m], w[t + 3][m]), high_halves(w[t + 2][m], w[t + 3][m])};
        mma(acc[m], a, b0.hi, b1.hi);
        mma(acc[m], a, b0.lo, b1.lo);
      }
    }
  }
  /// What acc holds per unit of output (the weights' scale).
  __device__ static constexpr float unscale() { return 1.0f / kWeightScale; }
};

/// q4_0 values: a 32-bit word holds 4 tokens of 2 channels (byte s: token 4·quad+s; low nibble
/// channel c of the block's low half, high nibble c + 16). Thread (g, k) loads words 2g and
/// 2g+1 of the token quads 2k and 2k+1 of each block (8 bytes each): m-tile 2b+u row g is
/// channel 32b + 2g + u, row g+8 is that + 16, and k-slots 2k, 2k+1, 2k+8, 2k+9 of k-tile kt are
/// tokens 8k + 4kt + 0, 2, 1, 3. Each token's scale multiplies its weight; the block's weights
/// are scaled by a power of two from the chunk's largest scale, so its sums are taken alone.
template <>
struct MmaValues<quant::Q4_0Codec<Plane::kValue>> {
  using Codec = quant::Q4_0Codec<Plane::kValue>;
  static constexpr bool kSupported = true;

  __device__ static int value_channel(index_t, int g, int m, bool upper) {
    return 32 * (m / 2) + 2 * g + m % 2 + (upper ? 16 : 0);
  }

  template <int MTiles>
  struct Chunk {
    uint2 words[MTiles / 2][2];  ///< per block and token quad 2k + kt: words 2g, 2g+1
    uint4 scales[MTiles / 2];    ///< per block: the fp16 scales of tokens 8k … 8k+7
  };

  template <int MTiles>
  __device__ static Chunk<MTiles> fetch(const std::byte* plane, quant::PageGeometry geometry, int chunk) {
    const int g = threadIdx.x % 32 / 4;
    const int k = threadIdx.x % 4;
    const int blocks_per_row = geometry.head_dim / 32;
    const std::byte* scales = plane + Codec::codes_bytes(geometry);
    Chunk<MTiles> fetched;
#pragma unroll
    for (int b = 0; b < MTiles / 2; ++b) {
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {
        const std::size_t quad = static_cast<std::size_t>(8 * chunk + 2 * k + kt);
        fetched.words[b][kt] = decode_detail::load<uint2>(plane + ((quad * blocks_per_row + b) * 16 + 2 * g) * 4);
      }
      fetched.scales[b] =
          decode_detail::load<uint4>(scales + (static_cast<std::size_t>(b) * geometry.page_size + 32 * chunk + 8 * k) * 2);
    }
    return fetched;
  }

  template <int MTiles>
  __device__ static void accumulate(const Chunk<MTiles>& fetched, const float (&p)[8], float (&acc)[MTiles][4]) {
    using namespace mma_detail;
#pragma unroll
    for (int b = 0; b < MTiles / 2; ++b) {
      const __half2* d = reinterpret_cast<const __half2*>(&fetched.scales[b]);  // tokens 8k … 8k+7
      float w[8];
      float largest = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 pair = __half22float2(d[i]);
        largest = fmaxf(largest, fmaxf(fabsf(pair.x), fabsf(pair.y)));
        w[2 * i] = p[2 * i] * pair.x;
        w[2 * i + 1] = p[2 * i + 1] * pair.y;
      }
      // One power of two for every token of the chunk: the k-slots of a column span all four k.
      const float scale = fp16_range_scale(quad_max(largest));
      float c[2][4] = {};
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {
        const SplitPair b0 = split(w[4 * kt] * scale, w[4 * kt + 2] * scale);
        const SplitPair b1 = split(w[4 * kt + 1] * scale, w[4 * kt + 3] * scale);
        const std::uint32_t word[2] = {fetched.words[b][kt].x, fetched.words[b][kt].y};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const std::uint32_t a[4] = {nibble_pair(word[u], 0), nibble_pair(word[u], 4), nibble_pair(word[u], 8),
                                      nibble_pair(word[u], 12)};
          mma(c[u], a, b0.hi, b1.hi);
          mma(c[u], a, b0.lo, b1.lo);
        }
      }
      const float unscale = 1.0f / scale;  // a power of two: exact
#pragma unroll
      for (int u = 0; u < 2; ++u) {
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[2 * b + u][r] = fmaf(c[u][r], unscale, acc[2 * b + u][r]);
      }
    }
  }
  __device__ static constexpr float unscale() { return 1.0f; }
};

/// Codec pairs the tensor-core kernel reads.
template <class KeyCodec, class ValueCodec>
concept MmaReadable = MmaKeys<KeyCodec>::kSupported && MmaValues<ValueCodec>::kSupported;

}  // namespace kvpack::inline v0::kernels::cuda
