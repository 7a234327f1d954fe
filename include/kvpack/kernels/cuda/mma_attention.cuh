#pragma once
/// \file mma_attention.cuh
/// \brief Decode attention on tensor cores, for the codec pairs whose page bytes load straight
///        into mma operands (mma_tiles.cuh: fp16 and q4_0). attend_paged picks it when it fits.
///
/// Grid (split, stream, head pass), four warps a block. The warps of a block take the split's
/// pages in turn, each with its own online softmax, and never wait for one another: no staging
/// through shared memory and no barrier in the loop. A warp loads a chunk's bytes into registers
/// and multiplies them on tensor cores, so the instructions per byte are few and many independent
/// warps keep the HBM read in flight. At the end the block merges its warps into one partial
/// result. The stream's full-precision tail rows are a partial of their own (tail_kernel); the
/// caller merges all of them with combine_kernel.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <type_traits>

#include "kvpack/core/types.hpp"
#include "kvpack/kernels/cuda/check.cuh"
#include "kvpack/kernels/cuda/mma_tiles.cuh"
#include "kvpack/kernels/cuda/warp_reduce.cuh"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::kernels::cuda {

namespace mma_attention_detail {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kHeads = 8;          ///< query heads per pass: the output product's n
inline constexpr int kPagesPerWarp = 2;   ///< no split shorter than this many pages per warp
inline constexpr int kMaxTailRows = 256;  ///< tail rows the tail kernel holds in shared memory
inline constexpr int kTailThreads = 256;

/// Slots 2k, 2k+1, 2k+8, 2k+9 of a k-tile: the query elements thread (g, k) holds.
__device__ __forceinline__ int query_slot(int k, int i) { return 2 * k + (i % 2) + (i / 2) * 8; }

/// Head g of the pass as the score product's A operand, scaled so that its largest element is in
/// [2^14, 2^15) (zero for heads past the group's end).
template <class Keys, int KTiles>
__device__ QueryFragments<KTiles> load_query(const float* row, bool present) {
  using namespace mma_detail;
  const int k = threadIdx.x % 4;
  float values[KTiles][4];
  float largest = 0.0f;
#pragma unroll
  for (int kt = 0; kt < KTiles; ++kt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      values[kt][i] = present ? row[Keys::channel(kt, query_slot(k, i))] : 0.0f;
      largest = fmaxf(largest, fabsf(values[kt][i]));
    }
  }
  const float scale = fp16_range_scale(quad_max(largest));
  QueryFragments<KTiles> q;
  q.unscale = 1.0f / scale;  // a power of two: exact
#pragma unroll
  for (int kt = 0; kt < KTiles; ++kt) {
    const SplitPair low = split(values[kt][0] * scale, values[kt][1] * scale);
    const SplitPair high = split(values[kt][2] * scale, values[kt][3] * scale);
    q.hi[kt][0] = low.hi;
    q.lo[kt][0] = low.lo;
    q.hi[kt][1] = high.hi;
    q.lo[kt][1] = high.lo;
  }
  return q;
}

/// One split of one stream for heads [pass·8, pass·8 + 8) of the group. Writes partial `blockIdx.x`
/// of `partials` per (stream, head): running max, sum and unnormalised accumulator.
template <class KeyCodec, class ValueCodec, int KTiles, class Args>
__global__ void __launch_bounds__(kThreads)
    split_kernel(Args a, index_t partials, float* part_max, float* part_sum, float* part_acc) {
  using namespace mma_detail;
  using Keys = MmaKeys<KeyCodec>;
  using Values = MmaValues<ValueCodec>;
  constexpr int MTiles = KTiles;  // head_dim / 16 channels either way
  const index_t stream = blockIdx.y;
  const index_t first_head = blockIdx.z * kHeads;
  const int heads = min(kHeads, a.group - first_head);
  const int warp = threadIdx.x / 32;
  const int g = threadIdx.x % 32 / 4;
  const int k = threadIdx.x % 4;
  const index_t d = a.head_dim;
  const quant::PageGeometry geometry{a.page_size, d};

  const std::size_t query_row = static_cast<std::size_t>(stream) * a.group + first_head + min(g, heads - 1);
  const QueryFragments<KTiles> q = load_query<Keys, KTiles>(a.queries + query_row * d, g < heads);

  const index_t first = a.first_page[stream];
  const index_t count = a.first_page[stream + 1] - first;
  const index_t per_split = (count + gridDim.x - 1) / gridDim.x;
  const index_t page_begin = min(count, static_cast<index_t>(blockIdx.x) * per_split);
  const index_t page_end = min(count, page_begin + per_split);
  const int chunks = a.page_size / 32;

  // Head g's running max and (this thread's share of the) sum; rows g, g+8 × heads 2k, 2k+1 of
  // every output m-tile.
  float run_max = -INFINITY;
  float run_sum = 0.0f;
  float acc[MTiles][4] = {};
  // Every load of a chunk, keys and values, is issued before any of it is used, and the next
  // page's address is read one page ahead: a chunk costs one memory round trip.
  const std::byte* payload = page_begin + warp < page_end ? a.pages[first + page_begin + warp] : nullptr;
  for (index_t page = page_begin + warp; page < page_end; page += kWarps) {
    const std::byte* next = page + kWarps < page_end ? a.pages[first + page + kWarps] : nullptr;
    for (int chunk = 0; chunk < chunks; ++chunk) {
      const auto keys = Keys::template fetch<KTiles>(payload, geometry, chunk);
      const auto values = Values::template fetch<MTiles>(payload + a.value_offset, geometry, chunk);
      float s[8] = {};
      Keys::score(keys, q, s);
      float top = -INFINITY;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        s[i] *= q.unscale;
        top = fmaxf(top, s[i]);
      }
      const float new_max = fmaxf(run_max, quad_max(top));
      const float factor = run_max == -INFINITY ? 0.0f : expf(run_max - new_max);
      float p[8];
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        p[i] = expf(s[i] - new_max);
        sum += p[i];
      }
      run_sum = run_sum * factor + sum;
      run_max = new_max;
      // Columns 2k and 2k+1 of the output are heads 2k and 2k+1: their factors live in quads 2k, 2k+1.
      const float even = __shfl_sync(0xffffffffu, factor, 8 * k);
      const float odd = __shfl_sync(0xffffffffu, factor, 8 * k + 4);
#pragma unroll
      for (int m = 0; m < MTiles; ++m) {
        acc[m][0] *= even;
        acc[m][1] *= odd;
        acc[m][2] *= even;
        acc[m][3] *= odd;
      }
      Values::accumulate(values, p, acc);
    }
    payload = next;
  }
  run_sum = quad_sum(run_sum);

  // Merge the warps: [warp][head] max and sum, [warp][head][channel] accumulators.
  extern __shared__ float merge[];
  float* merge_max = merge;
  float* merge_sum = merge_max + kWarps * kHeads;
  float* merge_acc = merge_sum + kWarps * kHeads;
  if (k == 0) {
    merge_max[warp * kHeads + g] = run_max;
    merge_sum[warp * kHeads + g] = run_sum;
  }
  const float unscale = Values::unscale();
  float* mine = merge_acc + static_cast<std::size_t>(warp) * kHeads * d;
#pragma unroll
  for (int m = 0; m < MTiles; ++m) {
    const int lower = Values::value_channel(d, g, m, false);
    const int upper = Values::value_channel(d, g, m, true);
    mine[(2 * k) * d + lower] = acc[m][0] * unscale;
    mine[(2 * k + 1) * d + lower] = acc[m][1] * unscale;
    mine[(2 * k) * d + upper] = acc[m][2] * unscale;
    mine[(2 * k + 1) * d + upper] = acc[m][3] * unscale;
  }
  __syncthreads();
  // A warp that saw no token has max −∞, weight 0 and zero sums; a NaN anywhere still reaches the
  // result (0 · NaN is NaN), as in combine_kernel.
  auto weight = [&](int w, int h, float top) {
    const float m = merge_max[w * kHeads + h];
    return m == -INFINITY ? 0.0f : expf(m - top);
  };
  auto block_max = [&](int h) {
    float top = -INFINITY;
    for (int w = 0; w < kWarps; ++w) top = fmaxf(top, merge_max[w * kHeads + h]);
    return top;
  };
  const std::size_t row = (static_cast<std::size_t>(stream) * partials + blockIdx.x) * a.group + first_head;
  for (index_t i = threadIdx.x; i < heads * d; i += kThreads) {
    const int h = i / d;
    const index_t c = i % d;
    const float top = block_max(h);
    float total = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      total += weight(w, h, top) * merge_acc[(static_cast<std::size_t>(w) * kHeads + h) * d + c];
    }
    part_acc[(row + h) * d + c] = total;
  }
  if (threadIdx.x < heads) {
    const int h = threadIdx.x;
    const float top = block_max(h);
    float total = 0.0f;
    for (int w = 0; w < kWarps; ++w) total += weight(w, h, top) * merge_sum[w * kHeads + h];
    part_max[row + h] = top;
    part_sum[row + h] = total;
  }
}

/// The stream's full-precision tail rows (at most kMaxTailRows) for heads [pass·8, pass·8 + 8),
/// in fp32: partial `slot` of `partials`.
template <class Args>
__global__ void __launch_bounds__(kTailThreads)
    tail_kernel(Args a, index_t partials, index_t slot, float* part_max, float* part_sum, float* part_acc) {
  __shared__ float weights[kHeads][kMaxTailRows];
  __shared__ float top_of[kHeads], sum_of[kHeads];
  const index_t stream = blockIdx.x;
  const index_t first_head = blockIdx.y * kHeads;
  const int heads = min(kHeads, a.group - first_head);
  const index_t d = a.head_dim;
  const index_t rows = a.tail_stride == 0 ? 0 : a.tail_count[stream];  // no tail: tail_count may be null
  const float* keys = a.tail_keys + static_cast<std::size_t>(stream) * a.tail_stride * d;
  const float* values = a.tail_values + static_cast<std::size_t>(stream) * a.tail_stride * d;
  const float* queries = a.queries + (static_cast<std::size_t>(stream) * a.group + first_head) * d;
  constexpr int kTailWarps = kTailThreads / 32;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  for (index_t t = warp; t < rows; t += kTailWarps) {
    for (int h = 0; h < heads; ++h) {
      float dot = 0.0f;
      for (index_t c = lane; c < d; c += 32) dot = fmaf(queries[h * d + c], keys[t * d + c], dot);
      dot = warp_sum(dot);
      if (lane == 0) weights[h][t] = dot;
    }
  }
  __syncthreads();
  for (int h = warp; h < heads; h += kTailWarps) {
    float top = -INFINITY;
    for (index_t t = lane; t < rows; t += 32) top = fmaxf(top, weights[h][t]);
    top = warp_max(top);
    float sum = 0.0f;
    for (index_t t = lane; t < rows; t += 32) {
      const float w = expf(weights[h][t] - top);
      weights[h][t] = w;
      sum += w;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      top_of[h] = top;
      sum_of[h] = sum;
    }
  }
  __syncthreads();
  const std::size_t row = (static_cast<std::size_t>(stream) * partials + slot) * a.group + first_head;
  for (index_t i = threadIdx.x; i < heads * d; i += kTailThreads) {
    const int h = i / d;
    const index_t c = i % d;
    float total = 0.0f;
    for (index_t t = 0; t < rows; ++t) total = fmaf(weights[h][t], values[t * d + c], total);
    part_acc[(row + h) * d + c] = total;
  }
  if (threadIdx.x < heads) {
    part_max[row + threadIdx.x] = top_of[threadIdx.x];
    part_sum[row + threadIdx.x] = sum_of[threadIdx.x];
  }
}

}  // namespace mma_attention_detail

/// Whether the tensor-core kernel takes a launch of this shape: whole 32-token chunks per page,
/// head_dim 64, 96 or 128 (256 would spill registers), value planes at a 16-byte offset, tails
/// the tail kernel holds.
template <class Args>
bool mma_attention_fits(const Args& a) {
  return a.page_size % 32 == 0 && (a.head_dim == 64 || a.head_dim == 96 || a.head_dim == 128) &&
         a.value_offset % 16 == 0 && a.payload_bytes % 16 == 0 && a.tail_stride <= mma_attention_detail::kMaxTailRows;
}

/// Launches the tensor-core splits and the tail kernel on `stream`; returns the number of
/// partials per (stream, head) they write (the splits, then the tail). `reserve(partials)` must
/// make the partial buffers large enough and return them.
template <class KeyCodec, class ValueCodec, class Args, class Reserve>
  requires MmaReadable<KeyCodec, ValueCodec>
index_t launch_mma_attention(const Args& a, index_t max_pages, int multiprocessors, Reserve&& reserve,
                             cudaStream_t stream) {
  using namespace mma_attention_detail;
  const index_t passes = (a.group + kHeads - 1) / kHeads;
  const std::size_t shared =
      (2 * kWarps * kHeads + static_cast<std::size_t>(kWarps) * kHeads * a.head_dim) * sizeof(float);
  auto launch = [&](auto tiles) {
    constexpr int KTiles = decltype(tiles)::value;
    auto* kernel = &split_kernel<KeyCodec, ValueCodec, KTiles, Args>;
    // One wave: as many blocks as the SMs hold at once (a second, partial wave would leave SMs
    // idle for its whole length), each split at least kPagesPerWarp pages per warp. The
    // occupancy is asked once per kernel (it depends on the kernel, not on the launch).
    static const int resident = [&] {
      int blocks = 0;
      check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, shared), "occupancy query");
      return std::max(1, blocks);
    }();
    const index_t wave = static_cast<index_t>(resident) * multiprocessors;
    const index_t longest = std::max<index_t>(1, max_pages / (kWarps * kPagesPerWarp));
    const index_t splits = std::clamp<index_t>(wave / (a.streams * passes), 1, longest);
    const auto [part_max, part_sum, part_acc] = reserve(splits + 1);
    const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(a.streams), static_cast<unsigned>(passes));
    kernel<<<grid, kThreads, shared, stream>>>(a, splits + 1, part_max, part_sum, part_acc);
    check(cudaGetLastError(), "tensor-core split kernel launch");
    tail_kernel<<<dim3(static_cast<unsigned>(a.streams), static_cast<unsigned>(passes)), kTailThreads, 0, stream>>>(
        a, splits + 1, splits, part_max, part_sum, part_acc);
    check(cudaGetLastError(), "tail kernel launch");
    return splits + 1;
  };
  switch (a.head_dim / 16) {
    case 4: return launch(std::integral_constant<int, 4>{});
    case 6: return launch(std::integral_constant<int, 6>{});
    default: return launch(std::integral_constant<int, 8>{});
  }
}

}  // namespace kvpack::inline v0::kernels::cuda
