#pragma once
/// \file paged_attention.cuh
/// \brief Decode attention on the GPU over paged, per-KV-head streams, reading the same page
///        bytes as the CPU kernels: split-K over pages (flash-decoding), then one combine.
///
/// Grid: (split, stream, head pass). A block owns a contiguous run of one stream's pages and up
/// to kMaxHeads query heads of the stream's group (GQA: the group shares every byte read; groups
/// larger than kMaxHeads read the stream once per pass of kMaxHeads heads). It walks its pages a
/// step at a time: the next step's payloads are copied into shared memory asynchronously
/// (cp.async) while the current step is scored, softmaxed online and accumulated, so the
/// HBM read stays in flight. Elements are decoded from shared memory by the codec's
/// ElementDecoder, two at a time and once for all heads of the pass. The last split also reads the
/// stream's full-precision tail rows. A second kernel merges the splits' (max, sum, acc).
///
/// Codecs whose decoders give rotated rows (TurboQuant-MSE, element_decode.hpp's rotated_space)
/// take the query into that space once per block and bring the pages' value sums back out of it
/// before the tail rows, which are stored as they came, add theirs.
///
/// This is the generic kernel: attend_paged sends codec pairs with tensor-core tiles (fp16, q4_0)
/// to mma_attention.cuh instead when the launch's shape fits it, and merges either with
/// combine_kernel.

#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <tuple>
#include <vector>

#include "kvpack/core/types.hpp"
#include "kvpack/kernels/cuda/check.cuh"
#include "kvpack/kernels/cuda/device_memory.cuh"
#include "kvpack/kernels/cuda/element_decode.hpp"
#include "kvpack/kernels/cuda/mma_attention.cuh"
#include "kvpack/kernels/cuda/warp_reduce.cuh"
#include "kvpack/kernels/paged_attention_args.hpp"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::kernels::cuda {

/// The launch arguments are backend-neutral (kernels/paged_attention_args.hpp); here every
/// pointer in them is device memory.
using ::kvpack::kernels::PagedAttentionArgs;

namespace attention_detail {

inline constexpr int kThreads = 256;
inline constexpr int kMaxHeadDim = 2 * kThreads;  ///< one value channel pair per thread at most
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kMaxHeads = 8;        ///< query heads per pass (registers per thread)
inline constexpr int kStepTokens = 64;     ///< most tokens per pipeline step (at least one page)
/// Most payload bytes per step (one page at least): small steps keep shared memory per block
/// low, so several blocks share each SM and their copies overlap each other's arithmetic.
inline constexpr std::size_t kStepBytes = 32u << 10;
inline constexpr int kBlocksPerSm = 8;     ///< blocks a launch aims for, per SM

/// How a launch is cut: pages per step, splits per stream, shared memory per block.
struct LaunchPlan {
  index_t step_pages = 1;
  index_t step_tokens = 0;
  index_t threads_per_token = 1;  ///< score threads sharing one token pair's channels
  index_t value_lanes = 1;        ///< value threads per channel pair, each over every value_lanes-th token
  index_t splits = 1;
  index_t passes = 1;
  std::size_t staging_bytes = 0;  ///< one staging buffer
  std::size_t floats_offset = 0;  ///< where the float arrays start, after the staging buffers
  std::size_t shared_bytes = 0;
};

/// heads[h] = p[h] for h < G, with the widest shared-memory loads G allows (p is 16-byte
/// aligned for G ≥ 4, 8-byte for G = 2): query and weights are stored head-minor so one load
/// serves every head of the pass.
template <int G>
__device__ __forceinline__ void load_heads(const float* p, float (&heads)[G]) {
  if constexpr (G % 4 == 0) {
#pragma unroll
    for (int j = 0; j < G / 4; ++j) {
      const float4 v = reinterpret_cast<const float4*>(p)[j];
      heads[4 * j] = v.x;
      heads[4 * j + 1] = v.y;
      heads[4 * j + 2] = v.z;
      heads[4 * j + 3] = v.w;
    }
  } else if constexpr (G == 2) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    heads[0] = v.x;
    heads[1] = v.y;
  } else {
    heads[0] = p[0];
  }
}

/// y[c][h] = Σ_j M[j][c]·x[j][h] for c < d and the G heads (M row-major [d][d] in global memory,
/// x and y head-minor [d][G] in shared memory). Every thread of the block takes part;
/// consecutive threads read consecutive columns of M. fp32 sums of d products.
template <int G>
__device__ void transform_heads(const float* M, index_t d, const float* x, float* y) {
  for (index_t i = threadIdx.x; i < G * d; i += kThreads) {
    const index_t h = i / d;
    const index_t c = i % d;
    float sum = 0.0f;
    for (index_t j = 0; j < d; ++j) sum = fmaf(M[static_cast<std::size_t>(j) * d + c], x[j * G + h], sum);
    y[c * G + h] = sum;
  }
}

/// One split of one stream for heads [pass·G, pass·G + G) of the group: writes its running
/// max, sum and unnormalised accumulator to the partial buffers.
template <class KeyDecoder, class ValueDecoder, int G, class KeyParams, class ValueParams>
__global__ void __launch_bounds__(kThreads)
    split_kernel(PagedAttentionArgs<KeyParams, ValueParams> a, LaunchPlan plan, float* part_max, float* part_sum,
                 float* part_acc) {
  const index_t stream = blockIdx.y;
  const index_t split = blockIdx.x;
  const index_t first_head = blockIdx.z * G;
  const index_t heads = min(G, a.group - first_head);
  const index_t d = a.head_dim;
  const index_t P = a.page_size;
  const index_t T = plan.step_tokens;
  const index_t tpt = plan.threads_per_token;
  const quant::PageGeometry geometry{P, d};
  const KeyParams key_params = a.key_params[stream];
  const ValueParams value_params = a.value_params[stream];

  extern __shared__ __align__(16) unsigned char shared[];
  // Buffer b of the two staging buffers. Computed, never stored in an array: a pointer read back
  // from (local) memory loses its shared address space and every page read becomes a generic load.
  auto staging = [&](index_t b) { return reinterpret_cast<std::byte*>(shared) + (b & 1) * plan.staging_bytes; };
  float* q = reinterpret_cast<float*>(shared + plan.floats_offset);     // [d][G], head-minor
  float* scores = q + G * d;                                                // [tpt][G][T]
  float* weights = scores + tpt * G * T;                                    // [T][G], head-minor
  float* run_max = weights + G * T;                                         // [G]
  float* run_sum = run_max + G;
  float* rescale = run_sum + G;
  // Rotated codecs: the query as given (for the tail rows) and the pages' value sums, [d][G] each.
  constexpr bool kRotatedKeys = rotated_space<KeyDecoder>;
  constexpr bool kRotatedValues = rotated_space<ValueDecoder>;
  float* row_query = rescale + G;
  float* value_sums = row_query + (kRotatedKeys ? G * d : 0);

  const index_t first = a.first_page[stream];
  const index_t count = a.first_page[stream + 1] - first;
  const index_t per_split = (count + gridDim.x - 1) / gridDim.x;
  const index_t page_begin = min(count, split * per_split);
  const index_t page_end = min(count, page_begin + per_split);
  // Without tail rows (tail_stride 0) the tail arrays may be null, as attend_paged allows.
  const index_t tail_rows = split == gridDim.x - 1 && a.tail_stride > 0 ? a.tail_count[stream] : 0;
  const index_t page_steps = (page_end - page_begin + plan.step_pages - 1) / plan.step_pages;
  const index_t steps = page_steps + (tail_rows + T - 1) / T;

  float* given = kRotatedKeys ? row_query : q;
  for (index_t i = threadIdx.x; i < G * d; i += kThreads) {
    const index_t h = i / d;
    const index_t c = i % d;
    const std::size_t row = static_cast<std::size_t>(stream) * a.group + first_head + h;
    given[c * G + h] = h < heads ? a.queries[row * d + c] : 0.0f;
  }
  if constexpr (kRotatedKeys) {
    __syncthreads();
    transform_heads<G>(key_params.transform, d, row_query, q);  // R q
  }
  // Work is done on pairs (ElementDecoder's token_pair and channel_pair), so each read can cover
  // two elements. This thread's value channels (channel, channel + 1) and token lane: it
  // accumulates them over tokens lane, lane + value_lanes, ... of every step, in registers.
  const index_t channel = 2 * (threadIdx.x % (d / 2));
  const index_t lane_of_tokens = threadIdx.x / (d / 2);
  const bool accumulates = lane_of_tokens < plan.value_lanes;
  // This thread's score tokens (score_token, score_token + 1) within a step, and its share of
  // their channels.
  const index_t score_token = 2 * (threadIdx.x % (T / 2));
  const index_t score_part = threadIdx.x / (T / 2);
  const index_t share = (d + tpt - 1) / tpt;
  float acc[G][2];
#pragma unroll
  for (int h = 0; h < G; ++h) acc[h][0] = acc[h][1] = 0.0f;
  if (threadIdx.x < G) {
    run_max[threadIdx.x] = -INFINITY;
    run_sum[threadIdx.x] = 0.0f;
  }

  // 32-bit loop arithmetic: a 64-bit division per 16-byte chunk once cost more than the math.
  const int chunks_per_page = static_cast<int>(a.payload_bytes / 16);
  auto stage = [&](index_t step) {
    if (step >= page_steps) return;
    const index_t page0 = page_begin + step * plan.step_pages;
    const index_t pages = min(plan.step_pages, page_end - page0);
    std::byte* dst = staging(step);
    for (index_t page = 0; page < pages; ++page) {
      std::byte* to = dst + static_cast<std::size_t>(page) * a.payload_bytes;
      const std::byte* from = a.pages[first + page0 + page];
      for (int chunk = threadIdx.x; chunk < chunks_per_page; chunk += kThreads) {
        __pipeline_memcpy_async(to + 16 * chunk, from + 16 * chunk, 16);
      }
    }
  };
  // The token lanes' accumulators, summed through the staging memory (once the pages are read):
  // store_lanes() writes every thread's channel pair, lane_total(i) adds element i = h·d + c of
  // all lanes.
  float* lane_sums = reinterpret_cast<float*>(shared);  // [value_lanes][G][d]
  auto store_lanes = [&] {
    if (accumulates) {
#pragma unroll
      for (int h = 0; h < G; ++h) {
        lane_sums[(lane_of_tokens * G + h) * d + channel] = acc[h][0];
        lane_sums[(lane_of_tokens * G + h) * d + channel + 1] = acc[h][1];
      }
    }
    __syncthreads();
  };
  auto lane_total = [&](index_t i) {
    float total = 0.0f;
    for (index_t lane = 0; lane < plan.value_lanes; ++lane) total += lane_sums[lane * G * d + i];
    return total;
  };
  // Rotated values: the pages' sums Σ w·(R v) become Rᵀ of them, in every thread's registers (the
  // token lanes summed into lane 0), before the tail's rows add theirs.
  [[maybe_unused]] auto turn_back_values = [&] {
    if constexpr (kRotatedValues) {  // value_params has a transform
      store_lanes();
      for (index_t i = threadIdx.x; i < G * d; i += kThreads) {  // [d][G], as transform_heads reads it
        value_sums[(i % d) * G + i / d] = lane_total(i);
      }
      __syncthreads();
      transform_heads<G>(value_params.transform, d, value_sums, lane_sums);  // Rᵀ s, as [d][G]
      __syncthreads();
      if (accumulates) {
#pragma unroll
        for (int h = 0; h < G; ++h) {
          acc[h][0] = lane_of_tokens == 0 ? lane_sums[channel * G + h] : 0.0f;
          acc[h][1] = lane_of_tokens == 0 ? lane_sums[(channel + 1) * G + h] : 0.0f;
        }
      }
      __syncthreads();  // the lanes are written again below
    }
  };

  stage(0);
  __pipeline_commit();

  for (index_t step = 0; step < steps; ++step) {
    stage(step + 1);
    __pipeline_commit();
    __pipeline_wait_prior(1);
    __syncthreads();
    if constexpr (kRotatedValues) {
      if (step == page_steps && page_steps > 0) turn_back_values();
    }

    const bool paged = step < page_steps;
    const std::byte* tile = staging(step);
    const index_t tail_first = (step - page_steps) * T;
    const index_t tokens = paged ? min(plan.step_pages, page_end - page_begin - step * plan.step_pages) * P
                                 : min(T, tail_rows - tail_first);
    const std::size_t tail_row = static_cast<std::size_t>(stream) * a.tail_stride + (paged ? 0 : tail_first);
    const float* tail_k = paged ? nullptr : a.tail_keys + tail_row * d;
    const float* tail_v = paged ? nullptr : a.tail_values + tail_row * d;

    // Scores: tpt threads per token pair (T/2 · tpt ≤ kThreads), each over a share of channels.
    if (score_part < tpt && score_token < tokens) {
      const index_t t = score_token;
      const index_t part = score_part;
      float s0[G], s1[G];
#pragma unroll
      for (int h = 0; h < G; ++h) s0[h] = s1[h] = 0.0f;
      const index_t c_end = min(d, (part + 1) * share);
      const float* query = paged ? q : given;  // the tail's rows are not rotated
      auto add = [&](index_t c, ElementPair k) {
        float qc[G];
        load_heads<G>(query + c * G, qc);
#pragma unroll
        for (int h = 0; h < G; ++h) {
          s0[h] = fmaf(qc[h], k.first, s0[h]);
          s1[h] = fmaf(qc[h], k.second, s1[h]);
        }
      };
      if (paged) {
        // Pages hold an even number of slots: both tokens sit in the same page.
        const std::byte* plane = tile + static_cast<std::size_t>(t / P) * a.payload_bytes;
        const index_t slot = t % P;
#pragma unroll 4
        for (index_t c = part * share; c < c_end; ++c) {
          add(c, token_pair<KeyDecoder>(plane, geometry, key_params, slot, c));
        }
      } else {
        // A tail step may end on an odd row: its pair partner then repeats it, and that score is
        // never read.
        const float* row0 = tail_k + static_cast<std::size_t>(t) * d;
        const float* row1 = t + 1 < tokens ? row0 + d : row0;
#pragma unroll 4
        for (index_t c = part * share; c < c_end; ++c) add(c, {row0[c], row1[c]});
      }
#pragma unroll
      for (int h = 0; h < G; ++h) {
        scores[(part * G + h) * T + t] = s0[h];
        scores[(part * G + h) * T + t + 1] = s1[h];
      }
    }
    __syncthreads();

    // Online softmax, one warp per head: sum the partial scores, new max, weights, new sum.
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    for (int h = warp; h < G; h += kWarps) {
      float top = -INFINITY;
      for (index_t t = lane; t < tokens; t += 32) {
        float s = scores[h * T + t];
        for (index_t part = 1; part < tpt; ++part) s += scores[(part * G + h) * T + t];
        scores[h * T + t] = s;
        top = fmaxf(top, s);
      }
      top = warp_max(top);
      const float old_max = run_max[h];
      const float new_max = fmaxf(old_max, top);
      float sum = 0.0f;
      for (index_t t = lane; t < tokens; t += 32) {
        const float w = expf(scores[h * T + t] - new_max);
        weights[t * G + h] = w;
        sum += w;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float factor = old_max == -INFINITY ? 0.0f : expf(old_max - new_max);
        rescale[h] = factor;
        run_max[h] = new_max;
        run_sum[h] = run_sum[h] * factor + sum;
      }
    }
    __syncthreads();

    // Values: all heads at once, each thread its channel over its lane of the step's tokens.
    if (accumulates) {
#pragma unroll
      for (int h = 0; h < G; ++h) {
        acc[h][0] *= rescale[h];
        acc[h][1] *= rescale[h];
      }
      auto add = [&](index_t t, ElementPair v) {
        float w[G];
        load_heads<G>(weights + t * G, w);
#pragma unroll
        for (int h = 0; h < G; ++h) {
          acc[h][0] = fmaf(w[h], v.first, acc[h][0]);
          acc[h][1] = fmaf(w[h], v.second, acc[h][1]);
        }
      };
      const index_t lanes = plan.value_lanes;
      if (paged) {
        // A paged step holds whole pages: walk them page by page (no division per token).
        for (index_t page = 0; page * P < tokens; ++page) {
          const std::byte* plane = tile + static_cast<std::size_t>(page) * a.payload_bytes + a.value_offset;
#pragma unroll 4
          for (index_t slot = lane_of_tokens; slot < P; slot += lanes) {
            add(page * P + slot, channel_pair<ValueDecoder>(plane, geometry, value_params, slot, channel));
          }
        }
      } else {
#pragma unroll 4
        for (index_t t = lane_of_tokens; t < tokens; t += lanes) {
          const float* row = tail_v + static_cast<std::size_t>(t) * d + channel;
          add(t, {row[0], row[1]});
        }
      }
    }
    __syncthreads();  // the next step stages into the buffer this one read
  }

  if constexpr (kRotatedValues) {
    if (steps == page_steps && page_steps > 0) turn_back_values();  // no tail steps came after the pages
  }
  // Sum the token lanes (the staging memory is free now) and write the split's partials.
  store_lanes();
  const std::size_t row = (static_cast<std::size_t>(stream) * gridDim.x + split) * a.group + first_head;
  for (index_t i = threadIdx.x; i < heads * d; i += kThreads) part_acc[row * d + i] = lane_total(i);
  if (threadIdx.x < heads) {
    part_max[row + threadIdx.x] = run_max[threadIdx.x];
    part_sum[row + threadIdx.x] = run_sum[threadIdx.x];
  }
}

/// out[stream][h] = Σ_split e^(m_split − M) acc_split / Σ_split e^(m_split − M) sum_split. One block
/// per (head, stream, 32 channels): the split weights are computed once into shared memory, then
/// each warp sums its share of the splits for 32 channels with coalesced loads, and the warps'
/// sums are added (a serial chain of hundreds of global reads per thread once took as long as
/// the attention itself).
__global__ void __launch_bounds__(kThreads)
    combine_kernel(const float* part_max, const float* part_sum, const float* part_acc, index_t splits,
                   index_t group, index_t d, float* out) {
  extern __shared__ float split_weight[];  // [splits]
  __shared__ float reduce[kWarps];
  __shared__ float shared_top;
  __shared__ float channel_sums[kWarps][32];
  const index_t stream = blockIdx.y;
  const index_t h = blockIdx.x;
  auto row = [&](index_t split) { return (static_cast<std::size_t>(stream) * splits + split) * group + h; };
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  float top = -INFINITY;
  for (index_t s = threadIdx.x; s < splits; s += kThreads) top = fmaxf(top, part_max[row(s)]);
  top = warp_max(top);
  if (lane == 0) reduce[warp] = top;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, reduce[w]);
    shared_top = m;
  }
  __syncthreads();
  top = shared_top;

  float denominator = 0.0f;
  for (index_t s = threadIdx.x; s < splits; s += kThreads) {
    const float m = part_max[row(s)];
    const float weight = m == -INFINITY ? 0.0f : expf(m - top);
    split_weight[s] = weight;
    denominator += weight * part_sum[row(s)];
  }
  denominator = warp_sum(denominator);
  __syncthreads();  // every reduce[] read above is done
  if (lane == 0) reduce[warp] = denominator;
  __syncthreads();
  denominator = 0.0f;
  for (int w = 0; w < kWarps; ++w) denominator += reduce[w];
  const float inverse = denominator > 0.0f ? 1.0f / denominator : 0.0f;

  const index_t c = static_cast<index_t>(blockIdx.z) * 32 + lane;
  float numerator = 0.0f;
  if (c < d) {
    // A split that saw no token has weight 0 and a zero accumulator.
#pragma unroll 4
    for (index_t s = warp; s < splits; s += kWarps) numerator += split_weight[s] * part_acc[row(s) * d + c];
  }
  channel_sums[warp][lane] = numerator;
  __syncthreads();
  if (warp == 0 && c < d) {
    float total = 0.0f;
    for (int w = 0; w < kWarps; ++w) total += channel_sums[w][lane];
    out[(static_cast<std::size_t>(stream) * group + h) * d + c] = total * inverse;
  }
}

}  // namespace attention_detail

/// Device scratch for the splits' partial results; grows to the largest launch, never shrinks.
class AttentionWorkspace {
 public:
  /// Room for `rows` partials of `head_dim` floats. Buffers that must grow wait for `stream`,
  /// whose launches may still read them; they double, as the split count grows with the context.
  void reserve(std::size_t rows, index_t head_dim, cudaStream_t stream) {
    if (max_.size() < rows || acc_.size() < rows * head_dim) {
      check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    }
    if (max_.size() < rows) {
      max_ = DeviceBuffer<float>(std::max(rows, 2 * max_.size()));
      sum_ = DeviceBuffer<float>(max_.size());
    }
    if (acc_.size() < rows * head_dim) acc_ = DeviceBuffer<float>(std::max(rows * head_dim, 2 * acc_.size()));
  }
  [[nodiscard]] float* max() const noexcept { return max_.data(); }
  [[nodiscard]] float* sum() const noexcept { return sum_.data(); }
  [[nodiscard]] float* acc() const noexcept { return acc_.data(); }
  [[nodiscard]] std::size_t bytes() const noexcept { return (max_.size() + sum_.size() + acc_.size()) * sizeof(float); }

 private:
  DeviceBuffer<float> max_, sum_, acc_;
};

/// Query heads one block serves: the smallest of 1, 2, 4, 8 covering the group (8 for larger
/// groups, read in several passes).
inline index_t heads_per_pass(index_t group) noexcept { return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8; }

/// What a launch needs to know of the current device, read once per device (attribute queries
/// cost microseconds; a decode step must not pay them).
struct DeviceLimits {
  int multiprocessors = 0;
  int shared_per_block = 0;
};
/// By value: another thread's first call on a higher device may grow the table (a reference
/// into it could dangle once the lock is released).
inline DeviceLimits device_limits() {
  static std::mutex mutex;
  static std::vector<DeviceLimits> per_device;
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  std::lock_guard lock(mutex);
  if (per_device.size() <= static_cast<std::size_t>(device)) per_device.resize(device + 1);
  DeviceLimits& limits = per_device[device];
  if (limits.multiprocessors == 0) {
    check(cudaDeviceGetAttribute(&limits.multiprocessors, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&limits.shared_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
          "cudaDeviceGetAttribute");
  }
  return limits;
}

/// The launch shape for these arguments on the current device: enough blocks to keep every
/// multiprocessor streaming (about kBlocksPerSm per SM), no split shorter than two pages.
/// `rotated_planes` (0 to 2) adds the rotated codecs' [d][G] arrays to the shared memory.
template <class KeyParams, class ValueParams>
attention_detail::LaunchPlan plan_launch(const PagedAttentionArgs<KeyParams, ValueParams>& a,
                                         index_t max_pages_per_stream, index_t rotated_planes = 0) {
  using namespace attention_detail;
  LaunchPlan plan;
  plan.step_pages = std::clamp<index_t>(static_cast<index_t>(kStepBytes / a.payload_bytes), 1,
                                        std::max<index_t>(1, kStepTokens / a.page_size));
  plan.step_tokens = plan.step_pages * a.page_size;
  // Each score thread owns one token of a step: a step never holds more tokens than threads
  // (page_size ≤ 256 = kThreads, and several pages only up to kStepTokens).
  KVPACK_CHECK(plan.step_tokens <= kThreads, kUnsupported,
               ::kvpack::detail::message("CUDA attention supports page_size up to ", kThreads, ", got ", a.page_size));
  plan.threads_per_token = std::max<index_t>(1, kThreads / (plan.step_tokens / 2));
  plan.value_lanes = kThreads / (a.head_dim / 2);
  plan.passes = (a.group + kMaxHeads - 1) / kMaxHeads;
  plan.staging_bytes = static_cast<std::size_t>(plan.step_pages) * a.payload_bytes;
  const std::size_t G = static_cast<std::size_t>(std::min<index_t>(heads_per_pass(a.group), kMaxHeads));
  const std::size_t floats = (1 + static_cast<std::size_t>(rotated_planes)) * G * a.head_dim +
                             static_cast<std::size_t>(plan.threads_per_token + 1) * G * plan.step_tokens + 3 * G;
  // The staging buffers are reused for the token lanes' sums at the end.
  const std::size_t staging = std::max(2 * plan.staging_bytes, plan.value_lanes * G * a.head_dim * sizeof(float));
  plan.floats_offset = (staging + 15) / 16 * 16;
  plan.shared_bytes = plan.floats_offset + floats * sizeof(float);

  const DeviceLimits& limits = device_limits();
  const int sms = limits.multiprocessors;
  KVPACK_CHECK(plan.shared_bytes <= static_cast<std::size_t>(limits.shared_per_block), kUnsupported,
               ::kvpack::detail::message("CUDA attention: a page of ", a.payload_bytes, " bytes needs ", plan.shared_bytes,
                                         " bytes of shared memory per block; this device allows ", limits.shared_per_block));
  const index_t blocks_per_split = a.streams * plan.passes;
  const index_t wanted = (kBlocksPerSm * sms + blocks_per_split - 1) / blocks_per_split;
  plan.splits = std::clamp<index_t>(wanted, 1, std::max<index_t>(1, max_pages_per_stream / 2));
  return plan;
}

/// Launches the generic kernel's splits on `stream`; returns the number of partials per (stream,
/// head) it writes.
template <class KeyCodec, class ValueCodec, class Args>
index_t launch_generic_attention(const Args& a, index_t max_pages, AttentionWorkspace& workspace, cudaStream_t stream) {
  using namespace attention_detail;
  using KP = device_params_t<KeyCodec>;
  using VP = device_params_t<ValueCodec>;
  const index_t rotated_planes = (rotated_space<ElementDecoder<KeyCodec>> ? 1 : 0) +
                                 (rotated_space<ElementDecoder<ValueCodec>> ? 1 : 0);
  const LaunchPlan plan = plan_launch(a, max_pages, rotated_planes);
  workspace.reserve(static_cast<std::size_t>(a.streams) * plan.splits * a.group, a.head_dim, stream);

  auto launch = [&](auto heads) {
    constexpr int G = decltype(heads)::value;
    auto* kernel = &split_kernel<ElementDecoder<KeyCodec>, ElementDecoder<ValueCodec>, G, KP, VP>;
    // Raise the kernel's shared-memory limit when a launch needs more than the default 48 KiB, at
    // every such launch: the attribute is per device, and a process may launch on several.
    if (plan.shared_bytes > (48u << 10)) {
      check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, device_limits().shared_per_block),
            "cudaFuncSetAttribute");
    }
    const dim3 grid(static_cast<unsigned>(plan.splits), static_cast<unsigned>(a.streams), static_cast<unsigned>(plan.passes));
    kernel<<<grid, kThreads, plan.shared_bytes, stream>>>(a, plan, workspace.max(), workspace.sum(), workspace.acc());
  };
  switch (heads_per_pass(a.group)) {
    case 1: launch(std::integral_constant<int, 1>{}); break;
    case 2: launch(std::integral_constant<int, 2>{}); break;
    case 4: launch(std::integral_constant<int, 4>{}); break;
    default: launch(std::integral_constant<int, 8>{}); break;
  }
  check(cudaGetLastError(), "split kernel launch");
  return plan.splits;
}

/// Which kernel attend_paged may use: the best that takes the launch, or the generic one always
/// (for comparisons).
enum class AttentionKernel { kBest, kGeneric };

/// Whether attend_paged runs a launch with these arguments on the tensor-core kernel
/// (mma_attention.cuh) rather than the generic one.
template <quant::Codec KeyCodec, quant::Codec ValueCodec, class Args>
bool attends_on_tensor_cores(const Args& a, AttentionKernel kernel = AttentionKernel::kBest) {
  if constexpr (MmaReadable<KeyCodec, ValueCodec>) return kernel == AttentionKernel::kBest && mma_attention_fits(a);
  return false;
}

/// out = softmax(q·Kᵀ) V for every stream and query head of `a`, on `stream`. `max_pages` is the
/// most pages any stream holds (it bounds the split count). Codec pairs with tensor-core tiles
/// (mma_tiles.cuh) take the tensor-core kernel when the shape fits it, every other launch the
/// generic one. Asynchronous: synchronise `stream` before reading `a.out`.
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
  requires DeviceDecodable<KeyCodec> && DeviceDecodable<ValueCodec>
void attend_paged(const PagedAttentionArgs<device_params_t<KeyCodec>, device_params_t<ValueCodec>>& a,
                  index_t max_pages, AttentionWorkspace& workspace, cudaStream_t stream = nullptr,
                  AttentionKernel kernel = AttentionKernel::kBest) {
  using namespace attention_detail;
  KVPACK_CHECK(a.streams > 0 && a.group > 0 && a.head_dim > 0 && a.page_size > 0, kInvalidArgument,
               "CUDA attention: streams, group, head_dim and page_size must be positive");
  // Codecs with device parameters (KVQuant, TurboQuant) skip check_launch's plane checks, so these
  // are the only ones between a bad size and a division by zero or a misaligned __half2 load.
  KVPACK_CHECK(a.payload_bytes > 0 && a.payload_bytes % 64 == 0 && a.value_offset < a.payload_bytes &&
                   a.value_offset % 16 == 0,
               kInvalidArgument,
               ::kvpack::detail::message("CUDA attention: payload_bytes (", a.payload_bytes,
                                         ") must be a positive multiple of 64 and value_offset (", a.value_offset,
                                         ") a multiple of 16 inside it"));
  // Streams index gridDim.y, at most 65535.
  KVPACK_CHECK(a.streams <= 65535, kUnsupported,
               ::kvpack::detail::message("CUDA attention launches at most 65535 streams at once, got ", a.streams));
  KVPACK_CHECK(a.head_dim <= kMaxHeadDim && a.head_dim % 2 == 0, kUnsupported,
               ::kvpack::detail::message("CUDA attention supports even head_dim up to ", kMaxHeadDim, ", got ",
                                         a.head_dim));
  // The generic kernel scores slots in pairs that must not straddle a page (and fp16 pairs load
  // as __half2): pages of an even number of slots, as every cache's (multiples of 16) are.
  KVPACK_CHECK(a.page_size % 2 == 0, kUnsupported,
               ::kvpack::detail::message("CUDA attention needs an even page_size, got ", a.page_size));
  const index_t partials = [&] {
    if constexpr (MmaReadable<KeyCodec, ValueCodec>) {
      if (attends_on_tensor_cores<KeyCodec, ValueCodec>(a, kernel)) {
        auto reserve = [&](index_t count) {
          workspace.reserve(static_cast<std::size_t>(a.streams) * count * a.group, a.head_dim, stream);
          return std::tuple{workspace.max(), workspace.sum(), workspace.acc()};
        };
        return launch_mma_attention<KeyCodec, ValueCodec>(a, max_pages, device_limits().multiprocessors, reserve, stream);
      }
    }
    return launch_generic_attention<KeyCodec, ValueCodec>(a, max_pages, workspace, stream);
  }();
  const dim3 combine_grid(static_cast<unsigned>(a.group), static_cast<unsigned>(a.streams),
                          static_cast<unsigned>((a.head_dim + 31) / 32));
  combine_kernel<<<combine_grid, kThreads, static_cast<std::size_t>(partials) * sizeof(float), stream>>>(
      workspace.max(), workspace.sum(), workspace.acc(), partials, a.group, a.head_dim, a.out);
  check(cudaGetLastError(), "combine kernel launch");
}

}  // namespace kvpack::inline v0::kernels::cuda
