#pragma once
/// \file rotation.hpp
/// \brief Seeded random rotations of R^d for TurboQuant and QJL (ALGORITHMS.md §3, §4.1):
///        a randomized Hadamard transform and a dense Haar-random orthogonal matrix.
///
/// - Randomized Hadamard: y = H·D·x / √d, D a diagonal of random signs, H the Sylvester
///   Hadamard matrix applied by the fast Walsh–Hadamard transform in O(d log d). Needs d a power
///   of two. Not what the paper analyses, but what most ports run.
/// - Dense: y = Q·x with Q the Gram–Schmidt orthonormalisation (twice, for accuracy) of a d×d
///   matrix of i.i.d. N(0, 1): equal in law to the Q factor of a QR with a positive diagonal,
///   i.e. Haar on O(d) — the paper's reference rotation. Computed in double here rather than
///   through Eigen so that no Eigen code reaches the per-ISA kernel objects (STYLE.md §5.2) and
///   the package keeps its dependencies.
///
/// Everything is reproducible from a 64-bit seed: std::mt19937_64's output is fixed by the
/// standard, and the normal deviates come from our own Box–Muller, not from
/// std::normal_distribution (whose algorithm each standard library chooses).
///
/// RotationView is the trivially copyable form kernels take; its apply functions compute in
/// double on the stack (head_dim ≤ kMaxRotationDim) so a rotated query carries no more error
/// than its final rounding to float.

#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "kvpack/config.hpp"
#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"

namespace kvpack::inline v0::quant {

/// Which rotation a TurboQuant codec applies.
enum class RotationKind : std::uint8_t {
  kAuto,      ///< Hadamard when head_dim is a power of two, dense otherwise
  kHadamard,  ///< randomized Hadamard (sign flips + fast Walsh–Hadamard)
  kDense,     ///< dense Haar-random orthogonal matrix
};

/// The largest head_dim a rotation (and the kernels' stack buffers) support.
inline constexpr index_t kMaxRotationDim = 1024;

constexpr bool is_power_of_two(index_t n) noexcept { return n > 0 && (n & (n - 1)) == 0; }

/// Deterministic N(0, 1) deviates from a seed (Box–Muller over std::mt19937_64).
class SeededNormal {
 public:
  explicit SeededNormal(std::uint64_t seed) : engine_(seed) {}
  double operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    // Uniforms in (0, 1]: 53 random bits, never 0, so the logarithm is finite.
    const double u1 = (static_cast<double>(engine_() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(engine_() >> 11) * 0x1.0p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 6.283185307179586476925 * u2;
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }
  std::uint64_t bits() { return engine_(); }

 private:
  std::mt19937_64 engine_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

/// A 64-bit seed for (base, stream): SplitMix64 of their combination, so neighbouring layers get
/// unrelated rotations.
constexpr std::uint64_t derive_seed(std::uint64_t base, std::uint64_t stream) noexcept {
  std::uint64_t z = base + 0x9E3779B97F4A7C15ull * (stream + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// In-place unnormalised fast Walsh–Hadamard transform of n (a power of two) doubles.
KVPACK_ALWAYS_INLINE void fwht(double* x, index_t n) noexcept {
  for (index_t h = 1; h < n; h *= 2) {
    for (index_t i = 0; i < n; i += 2 * h) {
      for (index_t j = i; j < i + h; ++j) {
        const double a = x[j];
        const double b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

/// A rotation as kernels see it: plain pointers into storage a Rotation owns.
struct RotationView {
  RotationKind kind = RotationKind::kHadamard;  ///< kHadamard or kDense, never kAuto
  index_t dim = 0;
  const float* signs = nullptr;   ///< [dim] ±1 (Hadamard)
  const float* matrix = nullptr;  ///< [dim][dim] row-major Q (dense): y = Q x
};
static_assert(std::is_trivially_copyable_v<RotationView>);

/// y = R x. `x` and `y` may alias.
KVPACK_ALWAYS_INLINE void rotate(const RotationView& r, const float* x, float* y) noexcept {
  double buffer[kMaxRotationDim];
  const index_t d = r.dim;
  if (r.kind == RotationKind::kHadamard) {
    for (index_t c = 0; c < d; ++c) buffer[c] = static_cast<double>(x[c]) * r.signs[c];
    fwht(buffer, d);
    const double norm = 1.0 / std::sqrt(static_cast<double>(d));
    for (index_t c = 0; c < d; ++c) y[c] = static_cast<float>(buffer[c] * norm);
    return;
  }
  for (index_t i = 0; i < d; ++i) {
    const float* row = r.matrix + static_cast<std::size_t>(i) * d;
    double sum = 0.0;
    for (index_t c = 0; c < d; ++c) sum += static_cast<double>(row[c]) * x[c];
    buffer[i] = sum;
  }
  for (index_t i = 0; i < d; ++i) y[i] = static_cast<float>(buffer[i]);
}

/// x = Rᵀ y (the inverse). `y` and `x` may alias.
KVPACK_ALWAYS_INLINE void unrotate(const RotationView& r, const float* y, float* x) noexcept {
  double buffer[kMaxRotationDim];
  const index_t d = r.dim;
  if (r.kind == RotationKind::kHadamard) {
    for (index_t c = 0; c < d; ++c) buffer[c] = y[c];
    fwht(buffer, d);
    const double norm = 1.0 / std::sqrt(static_cast<double>(d));
    for (index_t c = 0; c < d; ++c) x[c] = static_cast<float>(buffer[c] * norm * r.signs[c]);
    return;
  }
  for (index_t c = 0; c < d; ++c) buffer[c] = 0.0;
  for (index_t i = 0; i < d; ++i) {
    const float* row = r.matrix + static_cast<std::size_t>(i) * d;
    const double yi = y[i];
    for (index_t c = 0; c < d; ++c) buffer[c] += static_cast<double>(row[c]) * yi;
  }
  for (index_t c = 0; c < d; ++c) x[c] = static_cast<float>(buffer[c]);
}

/// A seeded rotation of R^dim with its storage.
class Rotation {
 public:
  Rotation() = default;
  /// `kind` kAuto picks Hadamard for a power-of-two `dim`, dense otherwise.
  /// \throws kvpack::Error kInvalidArgument for a dim outside [1, kMaxRotationDim] (the kernels'
  ///         buffers) or a Hadamard rotation of a dim that is not a power of two.
  Rotation(RotationKind kind, index_t dim, std::uint64_t seed) : dim_(dim), seed_(seed) {
    KVPACK_CHECK(dim >= 1 && dim <= kMaxRotationDim, kInvalidArgument,
                 ::kvpack::detail::message("Rotation: dim must be in [1, ", kMaxRotationDim, "], got ", dim));
    KVPACK_CHECK(kind != RotationKind::kHadamard || is_power_of_two(dim), kInvalidArgument,
                 ::kvpack::detail::message("Rotation: a Hadamard rotation needs a power-of-two dim, got ", dim));
    if (kind == RotationKind::kAuto) kind = is_power_of_two(dim) ? RotationKind::kHadamard : RotationKind::kDense;
    kind_ = kind;
    SeededNormal normal(seed);
    if (kind == RotationKind::kHadamard) {
      signs_.resize(static_cast<std::size_t>(dim));
      for (float& s : signs_) s = (normal.bits() >> 63) != 0 ? -1.0f : 1.0f;
      return;
    }
    const std::size_t n = static_cast<std::size_t>(dim);
    std::vector<double> q(n * n);
    for (double& v : q) v = normal();
    // Modified Gram–Schmidt over the rows, twice ("twice is enough", Giraud et al.).
    for (std::size_t i = 0; i < n; ++i) {
      double* row = q.data() + i * n;
      for (int pass = 0; pass < 2; ++pass) {
        for (std::size_t j = 0; j < i; ++j) {
          const double* other = q.data() + j * n;
          double dot = 0.0;
          for (std::size_t c = 0; c < n; ++c) dot += row[c] * other[c];
          for (std::size_t c = 0; c < n; ++c) row[c] -= dot * other[c];
        }
      }
      double norm = 0.0;
      for (std::size_t c = 0; c < n; ++c) norm += row[c] * row[c];
      norm = 1.0 / std::sqrt(norm);
      for (std::size_t c = 0; c < n; ++c) row[c] *= norm;
    }
    matrix_.assign(q.begin(), q.end());
  }

  [[nodiscard]] RotationKind kind() const noexcept { return kind_; }
  [[nodiscard]] index_t dim() const noexcept { return dim_; }
  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }
  [[nodiscard]] RotationView view() const noexcept {
    return {kind_, dim_, signs_.empty() ? nullptr : signs_.data(), matrix_.empty() ? nullptr : matrix_.data()};
  }
  void apply(const float* x, float* y) const noexcept { rotate(view(), x, y); }
  void apply_transpose(const float* y, float* x) const noexcept { unrotate(view(), y, x); }

 private:
  RotationKind kind_ = RotationKind::kHadamard;
  index_t dim_ = 0;
  std::uint64_t seed_ = 0;
  std::vector<float> signs_;
  std::vector<float> matrix_;
};

}  // namespace kvpack::inline v0::quant
