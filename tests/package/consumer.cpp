// A downstream program: builds a small KV cache, prefills it, runs decode attention and checks
// that every output is finite and a convex combination of the stored values (softmax weights).
// Compiled by the find_package consumer (with kvpack::cpu_dispatch, and kvpack::cuda where nvcc
// built it) and the add_subdirectory consumer (header-only); KVPACK_EXPECT_* say which.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <string_view>
#include <vector>

#include "kvpack/kvpack.hpp"

#ifndef KVPACK_EXPECT_DISPATCH
#error "the consumer's CMakeLists.txt defines KVPACK_EXPECT_DISPATCH"
#endif
static_assert(KVPACK_HAS_CPU_DISPATCH == KVPACK_EXPECT_DISPATCH,
              "KVPACK_HAS_CPU_DISPATCH must be 1 exactly when kvpack::cpu_dispatch is linked");
#ifndef KVPACK_EXPECT_CUDA
#error "the consumer's CMakeLists.txt defines KVPACK_EXPECT_CUDA"
#endif
static_assert(KVPACK_HAS_CUDA == KVPACK_EXPECT_CUDA, "KVPACK_HAS_CUDA must be 1 exactly when kvpack::cuda is linked");

namespace {

template <class Quantizer>
bool attend_is_sane(const char* name) {
  const kvpack::ModelShape shape{.layers = 1, .q_heads = 4, .kv_heads = 2, .head_dim = 32};
  kvpack::CacheConfig config;
  config.page_size = 16;
  kvpack::KVCache<kvpack::layout::GQA, Quantizer> cache(shape, config);

  constexpr int kTokens = 40;  // two full pages and a partial one
  const std::size_t row = static_cast<std::size_t>(shape.kv_heads) * shape.head_dim;
  std::vector<float> keys(kTokens * row);
  std::vector<float> values(kTokens * row);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    keys[i] = std::sin(0.37f * static_cast<float>(i));
    values[i] = std::cos(0.11f * static_cast<float>(i));
  }
  std::vector<float> query(static_cast<std::size_t>(shape.q_heads) * shape.head_dim);
  for (std::size_t i = 0; i < query.size(); ++i) query[i] = std::sin(0.05f * static_cast<float>(i) + 1.0f);
  std::vector<float> out(query.size(), 0.0f);

  const kvpack::SeqId seq = cache.add_sequence();
  cache.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values));
  cache.attend(seq, 0, std::span<const float>(query), std::span<float>(out),
               1.0f / std::sqrt(static_cast<float>(shape.head_dim)));

  const auto [lo, hi] = std::minmax_element(values.begin(), values.end());
  const float slack = 0.05f;  // quantization error of the stored values
  for (float x : out) {
    if (!std::isfinite(x) || x < *lo - slack || x > *hi + slack) {
      std::printf("%s: attend produced %g, outside [%g, %g]\n", name, static_cast<double>(x),
                  static_cast<double>(*lo), static_cast<double>(*hi));
      return false;
    }
  }
  std::printf("%s: ok (out[0] = %g)\n", name, static_cast<double>(out[0]));
  return true;
}

}  // namespace

int main() {
  const std::string_view isa = kvpack::dispatch::active_cpu_isa();
  std::printf("kvpack %s, CPU kernels: %.*s\n", KVPACK_EXPECT_DISPATCH ? "with cpu_dispatch" : "header-only",
              static_cast<int>(isa.size()), isa.data());
  bool ok = !isa.empty();
  ok = attend_is_sane<kvpack::quant::Float<float>>("f32") && ok;
  ok = attend_is_sane<kvpack::quant::Q8_0>("q8_0") && ok;
#if KVPACK_HAS_CUDA
  // The nvcc-built library answers from host-compiled code, and host memory stays on the CPU.
  const std::vector<float> host(4);
  std::printf("kvpack::cuda linked: %d CUDA device(s)\n", kvpack::cuda_api::device_count());
  ok = kvpack::dispatch::backend_of(host.data()) == kvpack::dispatch::Backend::kCpu && ok;
#endif
  return ok ? 0 : 1;
}
