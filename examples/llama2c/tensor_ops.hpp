#pragma once
/// \file tensor_ops.hpp
/// \brief The dense operations of a llama forward pass on one token, as plain loops: at
///        stories260K's size (dim 64) they cost less than the calls around them.
///
/// Accumulation is in float, in index order, as llama2.c does, so logits match its run.

#include <cassert>
#include <cmath>
#include <cstddef>
#include <span>

namespace llama2c::ops {

/// out = x / sqrt(mean(x²) + 1e-5) * weight. `out` may alias `x`.
inline void rms_norm(std::span<float> out, std::span<const float> x, std::span<const float> weight) {
  assert(out.size() == x.size() && weight.size() == x.size());
  float sum_squares = 0.0f;
  for (float v : x) sum_squares += v * v;
  const float inverse_rms = 1.0f / std::sqrt(sum_squares / static_cast<float>(x.size()) + 1e-5f);
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = weight[i] * (inverse_rms * x[i]);
}

/// out = W x for W row-major [out.size()][x.size()].
inline void matvec(std::span<float> out, std::span<const float> w, std::span<const float> x) {
  assert(w.size() == out.size() * x.size());
  for (std::size_t row = 0; row < out.size(); ++row) {
    const float* w_row = w.data() + row * x.size();
    float sum = 0.0f;
    for (std::size_t col = 0; col < x.size(); ++col) sum += w_row[col] * x[col];
    out[row] = sum;
  }
}

/// RoPE on adjacent pairs (2j, 2j+1) of every head in `x` ([heads][head_dim]): rotates pair j by
/// position · 10000^(-2j / head_dim).
inline void rotate_pairs(std::span<float> x, std::size_t head_dim, int position) {
  assert(head_dim % 2 == 0 && x.size() % head_dim == 0);
  for (std::size_t i = 0; i < x.size(); i += 2) {
    const float channel = static_cast<float>(i % head_dim);
    const float frequency = 1.0f / std::pow(10000.0f, channel / static_cast<float>(head_dim));
    const float angle = static_cast<float>(position) * frequency;
    const float cos_angle = std::cos(angle), sin_angle = std::sin(angle);
    const float a = x[i], b = x[i + 1];
    x[i] = a * cos_angle - b * sin_angle;
    x[i + 1] = a * sin_angle + b * cos_angle;
  }
}

/// gate = silu(gate) * up, the SwiGLU activation.
inline void swiglu(std::span<float> gate, std::span<const float> up) {
  assert(gate.size() == up.size());
  for (std::size_t i = 0; i < gate.size(); ++i) {
    const float g = gate[i];
    gate[i] = g * (1.0f / (1.0f + std::exp(-g))) * up[i];
  }
}

/// x += y (the residual connection).
inline void add(std::span<float> x, std::span<const float> y) {
  assert(x.size() == y.size());
  for (std::size_t i = 0; i < x.size(); ++i) x[i] += y[i];
}

}  // namespace llama2c::ops
