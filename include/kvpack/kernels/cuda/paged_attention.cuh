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
/// ElementDecoder, once per element for all heads of the pass. The last split also reads the
/// stream's full-precision tail rows. A second kernel merges the splits' (max, sum, acc).

#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvpack/core/types.hpp"
#include "kvpack/kernels/cuda/check.cuh"
#include "kvpack/kernels/cuda/device_memory.cuh"
#include "kvpack/kernels/cuda/element_decode.hpp"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::kernels::cuda {

/// Everything one launch reads; every pointer is device memory.
template <class KeyParams, class ValueParams>
struct PagedAttentionArgs {
  const std::byte* const* pages = nullptr;  ///< [total pages] payload addresses, streams back to back
  const index_t* first_page = nullptr;      ///< [streams + 1] where each stream's pages start
  const KeyParams* key_params = nullptr;    ///< [streams]
  const ValueParams* value_params = nullptr;  ///< [streams]
  const float* tail_keys = nullptr;    ///< [streams][tail_stride][head_dim] full-precision rows
  const float* tail_values = nullptr;  ///< [streams][tail_stride][head_dim]
  const index_t* tail_count = nullptr;  ///< [streams] rows in use
  index_t tail_stride = 0;
  const float* queries = nullptr;  ///< [streams][group][head_dim], softmax scale applied
  float* out = nullptr;            ///< [streams][group][head_dim]
  index_t streams = 0;
  index_t group = 0;
  index_t page_size = 0;
  index_t head_dim = 0;
  std::size_t value_offset = 0;   ///< bytes from a payload's start to its V plane
  std::size_t payload_bytes = 0;  ///< bytes per payload, a multiple of 64
};

namespace attention_detail {

inline constexpr int kThreads = 128;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kMaxHeads = 8;        ///< query heads per pass (registers per thread)
inline constexpr int kStepTokens = 64;     ///< tokens per pipeline step (at least one page)
inline constexpr std::size_t kStagingBudget = 96u << 10;  ///< both staging buffers, bytes

/// How a launch is cut: pages per step, splits per stream, shared memory per block.
struct LaunchPlan {
  index_t step_pages = 1;
  index_t step_tokens = 0;
  index_t threads_per_token = 1;  ///< score threads sharing one token's channels
  index_t splits = 1;
  index_t passes = 1;
  std::size_t staging_bytes = 0;  ///< one staging buffer
  std::size_t shared_bytes = 0;
};

__device__ inline float warp_max(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
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
  std::byte* staging[2] = {reinterpret_cast<std::byte*>(shared),
                           reinterpret_cast<std::byte*>(shared) + plan.staging_bytes};
  float* q = reinterpret_cast<float*>(shared + 2 * plan.staging_bytes);  // [G][d]
  float* acc = q + G * d;                                                   // [G][d]
  float* scores = acc + G * d;                                              // [tpt][G][T]
  float* run_max = scores + tpt * G * T;                                    // [G]
  float* run_sum = run_max + G;
  float* rescale = run_sum + G;

  const index_t first = a.first_page[stream];
  const index_t count = a.first_page[stream + 1] - first;
  const index_t per_split = (count + gridDim.x - 1) / gridDim.x;
  const index_t page_begin = min(count, split * per_split);
  const index_t page_end = min(count, page_begin + per_split);
  const index_t tail_rows = split == gridDim.x - 1 ? a.tail_count[stream] : 0;
  const index_t page_steps = (page_end - page_begin + plan.step_pages - 1) / plan.step_pages;
  const index_t steps = page_steps + (tail_rows + T - 1) / T;

  for (index_t i = threadIdx.x; i < G * d; i += kThreads) {
    const index_t h = i / d;
    q[i] = h < heads ? a.queries[(static_cast<std::size_t>(stream) * a.group + first_head + h) * d + i % d] : 0.0f;
    acc[i] = 0.0f;
  }
  if (threadIdx.x < G) {
    run_max[threadIdx.x] = -INFINITY;
    run_sum[threadIdx.x] = 0.0f;
  }

  const std::size_t chunks_per_page = a.payload_bytes / 16;
  auto stage = [&](index_t step) {
    if (step >= page_steps) return;
    const index_t page0 = page_begin + step * plan.step_pages;
    const index_t pages = min(plan.step_pages, page_end - page0);
    std::byte* dst = staging[step & 1];
    for (std::size_t i = threadIdx.x; i < pages * chunks_per_page; i += kThreads) {
      const std::size_t page = i / chunks_per_page;
      const std::size_t offset = (i % chunks_per_page) * 16;
      __pipeline_memcpy_async(dst + page * a.payload_bytes + offset, a.pages[first + page0 + page] + offset, 16);
    }
  };
  stage(0);
  __pipeline_commit();

  for (index_t step = 0; step < steps; ++step) {
    stage(step + 1);
    __pipeline_commit();
    __pipeline_wait_prior(1);
    __syncthreads();

    const bool paged = step < page_steps;
    const std::byte* tile = staging[step & 1];
    const index_t tail_first = (step - page_steps) * T;
    const index_t tokens = paged ? min(plan.step_pages, page_end - page_begin - step * plan.step_pages) * P
                                 : min(T, tail_rows - tail_first);
    const std::size_t tail_row = static_cast<std::size_t>(stream) * a.tail_stride + (paged ? 0 : tail_first);
    const float* tail_k = paged ? nullptr : a.tail_keys + tail_row * d;
    const float* tail_v = paged ? nullptr : a.tail_values + tail_row * d;

    // Scores: tpt threads per token, each over a contiguous share of the channels.
    const index_t share = (d + tpt - 1) / tpt;
    for (index_t i = threadIdx.x; i < tpt * T; i += kThreads) {
      const index_t t = i % T;
      const index_t part = i / T;
      if (t >= tokens) continue;
      float s[G];
#pragma unroll
      for (int h = 0; h < G; ++h) s[h] = 0.0f;
      const index_t c_end = min(d, (part + 1) * share);
      if (paged) {
        const std::byte* plane = tile + static_cast<std::size_t>(t / P) * a.payload_bytes;
        for (index_t c = part * share; c < c_end; ++c) {
          const float k = KeyDecoder::at(plane, geometry, key_params, t % P, c);
#pragma unroll
          for (int h = 0; h < G; ++h) s[h] += q[h * d + c] * k;
        }
      } else {
        for (index_t c = part * share; c < c_end; ++c) {
          const float k = tail_k[static_cast<std::size_t>(t) * d + c];
#pragma unroll
          for (int h = 0; h < G; ++h) s[h] += q[h * d + c] * k;
        }
      }
#pragma unroll
      for (int h = 0; h < G; ++h) scores[(part * G + h) * T + t] = s[h];
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
        scores[h * T + t] = w;
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

    // Values: one thread per channel, every token of the step, all heads at once.
    for (index_t c = threadIdx.x; c < d; c += kThreads) {
      float sum[G];
#pragma unroll
      for (int h = 0; h < G; ++h) sum[h] = acc[h * d + c] * rescale[h];
      if (paged) {
        // A paged step holds whole pages: walk them page by page (no division per token).
        for (index_t page = 0; page * P < tokens; ++page) {
          const std::byte* plane = tile + static_cast<std::size_t>(page) * a.payload_bytes + a.value_offset;
          const float* weights = scores + page * P;
          for (index_t slot = 0; slot < P; ++slot) {
            const float v = ValueDecoder::at(plane, geometry, value_params, slot, c);
#pragma unroll
            for (int h = 0; h < G; ++h) sum[h] += weights[h * T + slot] * v;
          }
        }
      } else {
        for (index_t t = 0; t < tokens; ++t) {
          const float v = tail_v[static_cast<std::size_t>(t) * d + c];
#pragma unroll
          for (int h = 0; h < G; ++h) sum[h] += scores[h * T + t] * v;
        }
      }
#pragma unroll
      for (int h = 0; h < G; ++h) acc[h * d + c] = sum[h];
    }
    __syncthreads();  // the next step stages into the buffer this one read
  }

  const std::size_t row = (static_cast<std::size_t>(stream) * gridDim.x + split) * a.group + first_head;
  for (index_t i = threadIdx.x; i < heads * d; i += kThreads) part_acc[row * d + i] = acc[i];
  if (threadIdx.x < heads) {
    part_max[row + threadIdx.x] = run_max[threadIdx.x];
    part_sum[row + threadIdx.x] = run_sum[threadIdx.x];
  }
}

/// out[stream][h] = Σ_split e^(m_split − M) acc_split / Σ_split e^(m_split − M) sum_split.
__global__ void __launch_bounds__(kThreads)
    combine_kernel(const float* part_max, const float* part_sum, const float* part_acc, index_t splits,
                   index_t group, index_t d, float* out) {
  const index_t stream = blockIdx.y;
  const index_t h = blockIdx.x;
  auto row = [&](index_t split) { return (static_cast<std::size_t>(stream) * splits + split) * group + h; };
  float top = -INFINITY;
  for (index_t s = 0; s < splits; ++s) top = fmaxf(top, part_max[row(s)]);
  float denominator = 0.0f;
  for (index_t s = 0; s < splits; ++s) {
    const float m = part_max[row(s)];
    if (m != -INFINITY) denominator += expf(m - top) * part_sum[row(s)];
  }
  const float inverse = denominator > 0.0f ? 1.0f / denominator : 0.0f;
  for (index_t c = threadIdx.x; c < d; c += kThreads) {
    float numerator = 0.0f;
    for (index_t s = 0; s < splits; ++s) {
      const float m = part_max[row(s)];
      if (m != -INFINITY) numerator += expf(m - top) * part_acc[row(s) * d + c];
    }
    out[(static_cast<std::size_t>(stream) * group + h) * d + c] = numerator * inverse;
  }
}

}  // namespace attention_detail

/// Device scratch for the splits' partial results; grows to the largest launch, never shrinks.
class AttentionWorkspace {
 public:
  void reserve(std::size_t rows, index_t head_dim) {
    if (max_.size() < rows) {
      max_ = DeviceBuffer<float>(rows);
      sum_ = DeviceBuffer<float>(rows);
    }
    if (acc_.size() < rows * head_dim) acc_ = DeviceBuffer<float>(rows * head_dim);
  }
  [[nodiscard]] float* max() const noexcept { return max_.data(); }
  [[nodiscard]] float* sum() const noexcept { return sum_.data(); }
  [[nodiscard]] float* acc() const noexcept { return acc_.data(); }

 private:
  DeviceBuffer<float> max_, sum_, acc_;
};

/// The launch shape for these arguments on the current device: enough blocks to keep every
/// multiprocessor streaming (about four per SM), no split shorter than two pages.
template <class KeyParams, class ValueParams>
attention_detail::LaunchPlan plan_launch(const PagedAttentionArgs<KeyParams, ValueParams>& a, index_t max_pages_per_stream) {
  using namespace attention_detail;
  LaunchPlan plan;
  plan.step_pages = std::max<index_t>(1, kStepTokens / a.page_size);
  while (plan.step_pages > 1 && 2 * plan.step_pages * a.payload_bytes > kStagingBudget) --plan.step_pages;
  plan.step_tokens = plan.step_pages * a.page_size;
  plan.threads_per_token = std::max<index_t>(1, kThreads / plan.step_tokens);
  plan.passes = (a.group + kMaxHeads - 1) / kMaxHeads;
  plan.staging_bytes = static_cast<std::size_t>(plan.step_pages) * a.payload_bytes;
  const std::size_t floats = 2 * static_cast<std::size_t>(kMaxHeads) * a.head_dim +
                             static_cast<std::size_t>(plan.threads_per_token) * kMaxHeads * plan.step_tokens +
                             3 * kMaxHeads;
  plan.shared_bytes = 2 * plan.staging_bytes + floats * sizeof(float);

  int device = 0;
  int sms = 0;
  int shared_limit = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
  KVPACK_CHECK(plan.shared_bytes <= static_cast<std::size_t>(shared_limit), kUnsupported,
               ::kvpack::detail::message("CUDA attention: a page of ", a.payload_bytes, " bytes needs ", plan.shared_bytes,
                                         " bytes of shared memory per block; this device allows ", shared_limit));
  const index_t blocks_per_split = a.streams * plan.passes;
  const index_t wanted = (4 * sms + blocks_per_split - 1) / blocks_per_split;
  plan.splits = std::clamp<index_t>(wanted, 1, std::max<index_t>(1, max_pages_per_stream / 2));
  return plan;
}

/// out = softmax(q·Kᵀ) V for every stream and query head of `a`, on `stream`. `max_pages` is the
/// most pages any stream holds (it bounds the split count). Asynchronous: synchronise `stream`
/// before reading `a.out`.
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
  requires DeviceDecodable<KeyCodec> && DeviceDecodable<ValueCodec>
void attend_paged(const PagedAttentionArgs<typename KeyCodec::params_type, typename ValueCodec::params_type>& a,
                  index_t max_pages, AttentionWorkspace& workspace, cudaStream_t stream = nullptr) {
  using namespace attention_detail;
  using KP = typename KeyCodec::params_type;
  using VP = typename ValueCodec::params_type;
  KVPACK_CHECK(a.streams > 0 && a.group > 0 && a.head_dim > 0 && a.page_size > 0, kInvalidArgument,
               "CUDA attention: streams, group, head_dim and page_size must be positive");
  KVPACK_CHECK(a.payload_bytes % 64 == 0, kInvalidArgument, "CUDA attention: payload_bytes must be a multiple of 64");
  const LaunchPlan plan = plan_launch(a, max_pages);
  workspace.reserve(static_cast<std::size_t>(a.streams) * plan.splits * a.group, a.head_dim);

  auto launch = [&](auto heads) {
    constexpr int G = decltype(heads)::value;
    auto* kernel = &split_kernel<ElementDecoder<KeyCodec>, ElementDecoder<ValueCodec>, G, KP, VP>;
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.shared_bytes)),
          "cudaFuncSetAttribute");
    const dim3 grid(static_cast<unsigned>(plan.splits), static_cast<unsigned>(a.streams), static_cast<unsigned>(plan.passes));
    kernel<<<grid, kThreads, plan.shared_bytes, stream>>>(a, plan, workspace.max(), workspace.sum(), workspace.acc());
  };
  // Heads per pass: the smallest of 1, 2, 4, 8 that covers the group (or 8 and several passes).
  if (a.group == 1) {
    launch(std::integral_constant<int, 1>{});
  } else if (a.group == 2) {
    launch(std::integral_constant<int, 2>{});
  } else if (a.group <= 4) {
    launch(std::integral_constant<int, 4>{});
  } else {
    launch(std::integral_constant<int, 8>{});
  }
  check(cudaGetLastError(), "split kernel launch");
  combine_kernel<<<dim3(static_cast<unsigned>(a.group), static_cast<unsigned>(a.streams)), kThreads, 0, stream>>>(
      workspace.max(), workspace.sum(), workspace.acc(), plan.splits, a.group, a.head_dim, a.out);
  check(cudaGetLastError(), "combine kernel launch");
}

}  // namespace kvpack::inline v0::kernels::cuda
