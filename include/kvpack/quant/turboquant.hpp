#pragma once
/// \file turboquant.hpp
/// \brief quant::TurboQuant (ALGORITHMS.md §4) and quant::QJL (§3): rotate, then quantize each
///        coordinate with a Lloyd–Max codebook of the sphere's coordinate density (MSE), or with
///        one bit fewer plus a 1-bit QJL sketch of the residual (Prod, unbiased inner products).
///
/// TurboQuant, per token x of head_dim d (a KV head's row):
///   n = ‖x‖, u = x / n, y = R u with R the layer's rotation (rotation.hpp, seeded per layer).
///   The first `high_channels` rotated coordinates get `high_bits`, the rest `low_bits` (equal
///   for integer rates; 2.5 bits = half at 3, half at 2 by default — the split is an option).
///   MSE:  idx_j = nearest centroid of the b_j-bit codebook (lloyd_max.hpp, in units 1/√d);
///         x̃ = n · Rᵀ c[idx].
///   Prod: idx_j with b_j − 1 bits, r = y − c[idx] (rotated space), γ = ‖r‖, s = sign(S r) with
///         S a d×d i.i.d. N(0, 1) sketch (seeded per layer);
///         x̃ = n · Rᵀ (c[idx] + √(π/2)/d · γ · Sᵀ s). Since S Rᵀ is again i.i.d. Gaussian, sketching
///         the rotated residual is the paper's Algorithm 2 with the sketch S Rᵀ.
///   Kernels never un-rotate keys: q·x̃ = n · (R q)·(c[idx] + …), with R q and S R q computed once
///   per call (kernels/cpu/turboquant.hpp).
///
/// Byte format of one plane (P = page_size tokens, token-major; all little-endian):
///   codes[P][row_bytes]: channel j's code at bit offset j·b_hi (j < n_hi) or
///       n_hi·b_hi + (j − n_hi)·b_lo, least significant bit first; row_bytes = ⌈row_bits/8⌉,
///       row_bits = n_hi·b_hi + (d − n_hi)·b_lo (the MSE code bits: b, or b − 1 for Prod);
///   Prod only: signs[P][⌈d/8⌉], bit j of a row = 1 when (S r)_j ≥ 0;
///   fp16 norm[P] (n);  Prod only: fp16 gamma[P] (γ, the residual norm of the unit vector).
/// True bits per element: (row_bits + [Prod] d + 16 · (1 + [Prod])) / d, e.g. d = 128:
///   MSE-4 4.125, MSE-3 3.125, MSE-2.5 2.625, Prod-3 3.25 (2-bit codes + 1 sign + two norms).
///
/// QJL<m> (keys only): s = sign(S k) with S an m×d i.i.d. N(0, 1) sketch (m = 2d by default, at
/// most 2d); stores s (m bits) and fp16 ‖k‖. Estimator ⟨q, k⟩ ≈ √(π/2)/m · ‖k‖ · ⟨S q, s⟩;
/// decode is the matching linear reconstruction k̃ = √(π/2)/m · ‖k‖ · Sᵀ s, so q·k̃ is exactly
/// the estimator.
/// Byte format: signs[P][m/8], then fp16 norm[P]. Bits per element (m + 16)/d.
///
/// Tables (codebooks, rotations, sketches) are built on first use per (head_dim, layer) and kept
/// in storage the codec shares with its copies (the cache copies the quantizer: addresses stay
/// stable). params_type holds a pointer to that storage, the layer and its seed.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvpack/config.hpp"
#include "kvpack/core/half.hpp"
#include "kvpack/error.hpp"
#include "kvpack/quant/lloyd_max.hpp"
#include "kvpack/quant/quant_concepts.hpp"
#include "kvpack/quant/rotation.hpp"

namespace kvpack::inline v0::quant {

/// TurboQuant's two estimators.
enum class TurboVariant : std::uint8_t {
  kMse,   ///< b-bit codes + norm: least squared error, inner products shrunk (biased)
  kProd,  ///< (b−1)-bit codes + 1-bit QJL residual sketch + two norms: unbiased inner products
};

/// A TurboQuant rate: `high_channels(d)` rotated channels at `high_bits`, the rest at `low_bits`.
struct TurboRate {
  int high_bits = 4;
  int low_bits = 4;
  double high_fraction = 0.0;  ///< share of rotated channels at high_bits (rounded to whole channels)

  [[nodiscard]] index_t high_channels(index_t d) const noexcept {
    return high_bits == low_bits ? 0 : static_cast<index_t>(std::lround(high_fraction * d));
  }
  /// b bits everywhere.
  static constexpr TurboRate integer(int bits) noexcept { return {bits, bits, 0.0}; }
  /// b + ½: half the rotated channels at b + 1 bits, half at b.
  static constexpr TurboRate half_step(int bits) noexcept { return {bits + 1, bits, 0.5}; }
  friend constexpr bool operator==(const TurboRate&, const TurboRate&) = default;
};

namespace turbo_detail {

inline constexpr int kMaxLevels = 16;  // 4-bit codes at most
inline constexpr double kSqrtHalfPi = 1.2533141373155002512;

/// Everything one (head_dim, layer) needs, immutable once built; `view` is what kernels read.
struct LayerView {
  RotationView rotation;          ///< R (TurboQuant); unused by QJL
  const float* sketch = nullptr;  ///< [sketch_rows][dim] row-major, N(0, 1); Prod and QJL
  const float* sketch_columns = nullptr;  ///< the same transposed, [dim][sketch_rows]: key planes only (S·q)
  index_t dim = 0;
  index_t sketch_rows = 0;        ///< d (Prod), m (QJL), 0 (MSE)
  index_t high_channels = 0;
  int high_bits = 0;              ///< code bits stored per channel (b or b − 1)
  int low_bits = 0;
  float high_centroids[kMaxLevels] = {};  ///< sphere units (t/√d), increasing
  float low_centroids[kMaxLevels] = {};
  float high_boundaries[kMaxLevels] = {};  ///< midpoints, [2^b − 1]
  float low_boundaries[kMaxLevels] = {};

  [[nodiscard]] constexpr int bits_of(index_t channel) const noexcept {
    return channel < high_channels ? high_bits : low_bits;
  }
  [[nodiscard]] constexpr std::size_t bit_offset(index_t channel) const noexcept {
    return channel < high_channels ? static_cast<std::size_t>(channel) * high_bits
                                   : static_cast<std::size_t>(high_channels) * high_bits +
                                         static_cast<std::size_t>(channel - high_channels) * low_bits;
  }
  [[nodiscard]] constexpr std::size_t row_bits() const noexcept { return bit_offset(dim); }
  [[nodiscard]] constexpr std::size_t row_bytes() const noexcept { return (row_bits() + 7) / 8; }
  [[nodiscard]] constexpr std::size_t sign_bytes() const noexcept {
    return (static_cast<std::size_t>(sketch_rows) + 7) / 8;
  }
  // The plane's sections for `page_size` tokens (the byte format in the file comment).
  [[nodiscard]] constexpr std::size_t signs_offset(index_t page_size) const noexcept {
    return row_bytes() * static_cast<std::size_t>(page_size);
  }
  [[nodiscard]] constexpr std::size_t norms_offset(index_t page_size) const noexcept {
    return signs_offset(page_size) + sign_bytes() * static_cast<std::size_t>(page_size);
  }
  [[nodiscard]] constexpr std::size_t gammas_offset(index_t page_size) const noexcept {
    return norms_offset(page_size) + 2 * static_cast<std::size_t>(page_size);
  }
};

struct LayerTables {
  index_t dim = 0;
  std::uint32_t layer = 0;
  std::uint64_t seed = 0;
  Rotation rotation;
  std::vector<float> sketch, sketch_columns;
  LayerView view;
  const LayerTables* next = nullptr;  ///< the list of TableStore
};

/// Codec-owned storage of LayerTables: an append-only list, built under a mutex and read
/// without one (readers only ever see fully built nodes, published with release/acquire).
class TableStore {
 public:
  TableStore() = default;
  TableStore(const TableStore&) = delete;
  TableStore& operator=(const TableStore&) = delete;
  ~TableStore() {
    const LayerTables* node = head_.load(std::memory_order_acquire);
    while (node != nullptr) {
      const LayerTables* next = node->next;
      delete node;
      node = next;
    }
  }

  /// The tables of (dim, layer), or nullptr when never built.
  [[nodiscard]] KVPACK_ALWAYS_INLINE const LayerTables* find(index_t dim, std::uint32_t layer) const noexcept {
    for (const LayerTables* node = head_.load(std::memory_order_acquire); node != nullptr; node = node->next) {
      if (node->dim == dim && node->layer == layer) return node;
    }
    return nullptr;
  }

  /// The tables of (dim, layer), built by `build(LayerTables&)` on first use.
  template <class Build>
  const LayerTables& get(index_t dim, std::uint32_t layer, Build&& build) const {
    if (const LayerTables* found = find(dim, layer)) return *found;
    std::lock_guard lock(mutex_);
    if (const LayerTables* found = find(dim, layer)) return *found;
    auto node = std::make_unique<LayerTables>();
    node->dim = dim;
    node->layer = layer;
    build(*node);
    node->next = head_.load(std::memory_order_relaxed);
    const LayerTables* published = node.release();
    head_.store(published, std::memory_order_release);
    return *published;
  }

 private:
  mutable std::mutex mutex_;
  mutable std::atomic<const LayerTables*> head_{nullptr};
};

/// The parameters of a TurboQuant or QJL plane: where its tables are, which layer, its seed.
struct Params {
  const TableStore* store = nullptr;
  std::uint32_t layer = 0;
  std::uint64_t seed = 0;  ///< the layer's rotation/sketch seed (derive_seed(codec seed, layer))
  friend constexpr bool operator==(const Params&, const Params&) = default;
};

/// The layer view for a plane of `dim` channels; the tables exist once a page was encoded.
KVPACK_ALWAYS_INLINE const LayerView& layer_view(const Params& p, index_t dim) noexcept {
  return p.store->find(dim, p.layer)->view;
}

inline void fill_codebook(index_t d, int bits, float* centroids, float* boundaries) {
  if (bits == 0) {  // Prod at 1 bit: no MSE codes, the residual is the whole vector
    centroids[0] = 0.0f;
    return;
  }
  const ScalarCodebook& book = sphere_codebook(d, bits);
  const double unit = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::size_t i = 0; i < book.centroids.size(); ++i) centroids[i] = static_cast<float>(book.centroids[i] * unit);
  for (std::size_t i = 0; i < book.boundaries.size(); ++i) boundaries[i] = static_cast<float>(book.boundaries[i] * unit);
}

/// A [rows][dim] matrix as [dim][rows].
inline std::vector<float> transposed(const std::vector<float>& m, index_t rows, index_t dim) {
  std::vector<float> t(m.size());
  for (index_t j = 0; j < rows; ++j) {
    for (index_t c = 0; c < dim; ++c) t[static_cast<std::size_t>(c) * rows + j] = m[static_cast<std::size_t>(j) * dim + c];
  }
  return t;
}

inline std::vector<float> gaussian_sketch(index_t rows, index_t dim, std::uint64_t seed) {
  SeededNormal normal(seed);
  std::vector<float> s(static_cast<std::size_t>(rows) * dim);
  for (float& v : s) v = static_cast<float>(normal());
  return s;
}

/// Code bits b (1..4) at a code position in a packed row, least significant bit first.
KVPACK_ALWAYS_INLINE unsigned get_bits(const std::byte* row, std::size_t bit, int bits) noexcept {
  unsigned word = static_cast<unsigned>(row[bit / 8]);
  if (bit % 8 + static_cast<std::size_t>(bits) > 8) word |= static_cast<unsigned>(row[bit / 8 + 1]) << 8;
  return (word >> (bit % 8)) & ((1u << bits) - 1u);
}
inline void put_bits(std::byte* row, std::size_t bit, int bits, unsigned code) noexcept {
  const unsigned shifted = code << (bit % 8);
  row[bit / 8] |= static_cast<std::byte>(shifted & 0xFFu);
  if (bit % 8 + static_cast<std::size_t>(bits) > 8) row[bit / 8 + 1] |= static_cast<std::byte>(shifted >> 8);
}
KVPACK_ALWAYS_INLINE float load_half(const std::byte* at) noexcept {
  std::uint16_t bits;
  std::memcpy(&bits, at, sizeof(bits));
  return half::from_bits(bits);
}
inline void store_half(std::byte* at, float x) noexcept {
  const std::uint16_t bits = half(x).bits;
  std::memcpy(at, &bits, sizeof(bits));
}

}  // namespace turbo_detail

/// Options of a TurboQuant plane codec.
struct TurboOptions {
  TurboRate rate = TurboRate::integer(4);
  RotationKind rotation = RotationKind::kAuto;
  std::uint64_t seed = 0x5475726230517561ull;  ///< per-layer seeds derive from it
  friend constexpr bool operator==(const TurboOptions&, const TurboOptions&) = default;
};

/// One plane (keys or values) of TurboQuant, MSE or Prod; the rate is a run-time option so one
/// kernel serves every rate.
template <TurboVariant Variant, Plane kPlaneOf>
class TurboCodec {
 public:
  using params_type = turbo_detail::Params;
  static constexpr std::string_view kName =
      Variant == TurboVariant::kMse ? (kPlaneOf == Plane::kKey ? "turbo_mse_key" : "turbo_mse_value")
                                    : (kPlaneOf == Plane::kKey ? "turbo_prod_key" : "turbo_prod_value");
  static constexpr Plane kPlane = kPlaneOf;
  static constexpr TurboVariant kVariant = Variant;
  /// Decoding then encoding moves codes (the rotation and the norm are recomputed in floats).
  static constexpr bool kReencodeStable = false;

  TurboCodec() : TurboCodec(TurboOptions{}) {}
  explicit TurboCodec(TurboOptions options)
      : options_(options), store_(std::make_shared<const turbo_detail::TableStore>()) {}

  [[nodiscard]] const TurboOptions& options() const noexcept { return options_; }

  void validate(PageGeometry g) const {
    const TurboRate r = options_.rate;
    KVPACK_CHECK(r.high_bits >= 1 && r.high_bits <= 4 && r.low_bits >= 1 && r.low_bits <= 4 &&
                     r.high_fraction >= 0.0 && r.high_fraction <= 1.0,
                 kUnsupported,
                 ::kvpack::detail::message("TurboQuant stores 1..4 bits per channel, not ", r.high_bits, "/",
                                           r.low_bits, " (share ", r.high_fraction, ")"));
    KVPACK_CHECK(g.head_dim >= 4 && g.head_dim <= kMaxRotationDim, kUnsupported,
                 ::kvpack::detail::message("TurboQuant rotates head_dim 4..", kMaxRotationDim, ", not ", g.head_dim));
    KVPACK_CHECK(options_.rotation != RotationKind::kHadamard || is_power_of_two(g.head_dim), kUnsupported,
                 ::kvpack::detail::message("the Hadamard rotation needs a power-of-two head_dim, not ", g.head_dim,
                                           "; use RotationKind::kDense or kAuto"));
  }

  [[nodiscard]] index_t high_channels(index_t d) const noexcept { return options_.rate.high_channels(d); }
  [[nodiscard]] int code_bits(bool high) const noexcept {
    const int b = high ? options_.rate.high_bits : options_.rate.low_bits;
    return Variant == TurboVariant::kProd ? b - 1 : b;
  }
  [[nodiscard]] std::size_t row_bits(index_t d) const noexcept {
    const index_t hi = high_channels(d);
    return static_cast<std::size_t>(hi) * code_bits(true) + static_cast<std::size_t>(d - hi) * code_bits(false);
  }
  [[nodiscard]] std::size_t row_bytes(index_t d) const noexcept { return (row_bits(d) + 7) / 8; }
  [[nodiscard]] static constexpr std::size_t sign_bytes(index_t d) noexcept {
    return Variant == TurboVariant::kProd ? (static_cast<std::size_t>(d) + 7) / 8 : 0;
  }
  [[nodiscard]] std::size_t signs_offset(PageGeometry g) const noexcept {
    return row_bytes(g.head_dim) * static_cast<std::size_t>(g.page_size);
  }
  [[nodiscard]] std::size_t norms_offset(PageGeometry g) const noexcept {
    return signs_offset(g) + sign_bytes(g.head_dim) * static_cast<std::size_t>(g.page_size);
  }
  [[nodiscard]] std::size_t gammas_offset(PageGeometry g) const noexcept {
    return norms_offset(g) + 2 * static_cast<std::size_t>(g.page_size);
  }
  [[nodiscard]] std::size_t plane_bytes(PageGeometry g) const noexcept {
    return gammas_offset(g) + (Variant == TurboVariant::kProd ? 2 * static_cast<std::size_t>(g.page_size) : 0);
  }
  [[nodiscard]] double nominal_bits_per_element(index_t d) const noexcept {
    const double per_token = static_cast<double>(row_bits(d)) + (Variant == TurboVariant::kProd ? d + 32.0 : 16.0);
    return per_token / d;
  }
  /// ‖x‖ ≤ √d · max|x| must stay below fp16's 65504 for head_dim up to kMaxRotationDim.
  [[nodiscard]] float max_abs_input() const noexcept { return 2000.0f; }

  [[nodiscard]] params_type initial_params(index_t layer, index_t) const {
    const auto l = static_cast<std::uint32_t>(layer);
    return {store_.get(), l, derive_seed(options_.seed, l)};
  }

  /// Builds the tables of (head_dim, layer) now: KVCache calls it when it is built, so encoding
  /// (after the cache's last possible throw) never allocates.
  void prepare(PageGeometry g, const params_type& p) const { (void)tables(g.head_dim, p); }

  /// The tables of (head_dim, layer), built on first use.
  [[nodiscard]] const turbo_detail::LayerTables& tables(index_t d, const params_type& p) const {
    return store_->get(d, p.layer, [&](turbo_detail::LayerTables& t) {
      t.seed = p.seed;
      t.rotation = Rotation(options_.rotation, d, p.seed);
      t.view.rotation = t.rotation.view();
      t.view.dim = d;
      t.view.high_channels = high_channels(d);
      t.view.high_bits = code_bits(true);
      t.view.low_bits = code_bits(false);
      turbo_detail::fill_codebook(d, t.view.high_bits, t.view.high_centroids, t.view.high_boundaries);
      turbo_detail::fill_codebook(d, t.view.low_bits, t.view.low_centroids, t.view.low_boundaries);
      if constexpr (Variant == TurboVariant::kProd) {
        t.sketch = turbo_detail::gaussian_sketch(d, d, derive_seed(p.seed, 0x51ull));
        t.view.sketch = t.sketch.data();
        t.view.sketch_rows = d;
        if constexpr (kPlaneOf == Plane::kKey) {  // only the key kernels sketch a query (d² floats)
          t.sketch_columns = turbo_detail::transposed(t.sketch, d, d);
          t.view.sketch_columns = t.sketch_columns.data();
        }
      }
    });
  }

  void encode(PageGeometry g, const float* src, std::ptrdiff_t row_stride, const params_type& p, std::byte* dst) const {
    const turbo_detail::LayerView& v = tables(g.head_dim, p).view;
    const index_t d = g.head_dim;
    std::fill(dst, dst + plane_bytes(g), std::byte{0});
    std::vector<float> unit(static_cast<std::size_t>(d)), y(unit.size()), residual(unit.size());
    for (index_t t = 0; t < g.page_size; ++t) {
      const float* x = src + t * row_stride;
      double norm2 = 0.0;
      for (index_t c = 0; c < d; ++c) norm2 += static_cast<double>(x[c]) * x[c];
      const double norm = std::sqrt(norm2);
      for (index_t c = 0; c < d; ++c) unit[c] = norm > 0.0 ? static_cast<float>(x[c] / norm) : 0.0f;
      rotate(v.rotation, unit.data(), y.data());
      std::byte* row = dst + row_bytes(d) * static_cast<std::size_t>(t);
      double gamma2 = 0.0;
      for (index_t c = 0; c < d; ++c) {
        const bool high = c < v.high_channels;
        const int bits = high ? v.high_bits : v.low_bits;
        const float* boundaries = high ? v.high_boundaries : v.low_boundaries;
        unsigned code = 0;
        for (int k = 0; k + 1 < (1 << bits); ++k) code += y[c] > boundaries[k] ? 1u : 0u;
        if (bits > 0) turbo_detail::put_bits(row, v.bit_offset(c), bits, code);
        residual[c] = y[c] - (high ? v.high_centroids : v.low_centroids)[code];
        gamma2 += static_cast<double>(residual[c]) * residual[c];
      }
      turbo_detail::store_half(dst + norms_offset(g) + 2 * static_cast<std::size_t>(t), static_cast<float>(norm));
      if constexpr (Variant == TurboVariant::kProd) {
        std::byte* signs = dst + signs_offset(g) + sign_bytes(d) * static_cast<std::size_t>(t);
        for (index_t j = 0; j < d; ++j) {
          const float* s = v.sketch + static_cast<std::size_t>(j) * d;
          double dot = 0.0;
          for (index_t c = 0; c < d; ++c) dot += static_cast<double>(s[c]) * residual[c];
          if (dot >= 0.0) signs[j / 8] |= static_cast<std::byte>(1u << (j % 8));
        }
        turbo_detail::store_half(dst + gammas_offset(g) + 2 * static_cast<std::size_t>(t),
                                 static_cast<float>(std::sqrt(gamma2)));
      }
    }
  }

  /// Writes the rotated-space reconstruction of token t (before the norm): c[idx] (+ the QJL
  /// term for Prod). Shared with the tests; kernels repeat it per arch.
  void decode_rotated(PageGeometry g, const std::byte* plane, const turbo_detail::LayerView& v, index_t t,
                      float* y) const noexcept {
    const index_t d = g.head_dim;
    const std::byte* row = plane + row_bytes(d) * static_cast<std::size_t>(t);
    for (index_t c = 0; c < d; ++c) {
      const bool high = c < v.high_channels;
      const int bits = high ? v.high_bits : v.low_bits;
      const unsigned code = bits > 0 ? turbo_detail::get_bits(row, v.bit_offset(c), bits) : 0u;
      y[c] = (high ? v.high_centroids : v.low_centroids)[code];
    }
    if constexpr (Variant == TurboVariant::kProd) {
      const std::byte* signs = plane + signs_offset(g) + sign_bytes(d) * static_cast<std::size_t>(t);
      const double coef = turbo_detail::kSqrtHalfPi / d *
                          turbo_detail::load_half(plane + gammas_offset(g) + 2 * static_cast<std::size_t>(t));
      double sum[kMaxRotationDim] = {};
      for (index_t j = 0; j < d; ++j) {  // Sᵀ s, row by row
        const double sign = (static_cast<unsigned>(signs[j / 8]) >> (j % 8)) & 1u ? 1.0 : -1.0;
        const float* row = v.sketch + static_cast<std::size_t>(j) * d;
        for (index_t c = 0; c < d; ++c) sum[c] += sign * row[c];
      }
      for (index_t c = 0; c < d; ++c) y[c] = static_cast<float>(y[c] + coef * sum[c]);
    }
  }

  void decode(PageGeometry g, const std::byte* plane, const params_type& p, float* dst) const {
    const turbo_detail::LayerView& v = tables(g.head_dim, p).view;
    const index_t d = g.head_dim;
    std::vector<float> y(static_cast<std::size_t>(d));
    for (index_t t = 0; t < g.page_size; ++t) {
      decode_rotated(g, plane, v, t, y.data());
      float* out = dst + static_cast<std::size_t>(t) * d;
      unrotate(v.rotation, y.data(), out);
      const float norm = turbo_detail::load_half(plane + norms_offset(g) + 2 * static_cast<std::size_t>(t));
      for (index_t c = 0; c < d; ++c) out[c] *= norm;
    }
  }

  friend bool operator==(const TurboCodec& a, const TurboCodec& b) noexcept { return a.options_ == b.options_; }

 private:
  TurboOptions options_;
  std::shared_ptr<const turbo_detail::TableStore> store_;
};

/// QJL's key codec: m sign bits of a Gaussian projection and the fp16 norm. The sketch size is a
/// run-time option (0: m = 2·head_dim, QJL's 2 bits per channel), so one kernel serves every m.
class QjlKeyCodec {
 public:
  using params_type = turbo_detail::Params;
  static constexpr std::string_view kName = "qjl_key";
  static constexpr Plane kPlane = Plane::kKey;
  /// As for TurboCodec: a sketch of decoded values is not the stored one.
  static constexpr bool kReencodeStable = false;

  QjlKeyCodec() : QjlKeyCodec(0) {}
  explicit QjlKeyCodec(index_t sketch_rows, std::uint64_t seed = 0x514A4C5F4B455953ull)
      : rows_(sketch_rows), seed_(seed), store_(std::make_shared<const turbo_detail::TableStore>()) {}

  /// m for head_dim d.
  [[nodiscard]] index_t sketch_rows(index_t d) const noexcept { return rows_ > 0 ? rows_ : 2 * d; }
  /// The constructor's arguments: the requested m (0: 2·head_dim) and the base seed.
  [[nodiscard]] index_t requested_rows() const noexcept { return rows_; }
  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }

  void validate(PageGeometry g) const {
    KVPACK_CHECK(rows_ >= 0, kInvalidConfig,
                 ::kvpack::detail::message("QJL's sketch rows must be > 0, or 0 for 2·head_dim; got ", rows_));
    KVPACK_CHECK(g.head_dim >= 1 && g.head_dim <= kMaxRotationDim, kUnsupported,
                 ::kvpack::detail::message("QJL sketches head_dim 1..", kMaxRotationDim, ", not ", g.head_dim));
    const index_t m = sketch_rows(g.head_dim);
    KVPACK_CHECK(m % 8 == 0 && m <= 2 * g.head_dim, kUnsupported,
                 ::kvpack::detail::message("QJL's sketch is whole bytes of sign bits and its kernels take at most "
                                           "2·head_dim = ", 2 * g.head_dim, " rows, not ", m));
  }
  [[nodiscard]] std::size_t sign_bytes(index_t d) const noexcept { return static_cast<std::size_t>(sketch_rows(d)) / 8; }
  [[nodiscard]] std::size_t norms_offset(PageGeometry g) const noexcept {
    return sign_bytes(g.head_dim) * static_cast<std::size_t>(g.page_size);
  }
  [[nodiscard]] std::size_t plane_bytes(PageGeometry g) const noexcept {
    return norms_offset(g) + 2 * static_cast<std::size_t>(g.page_size);
  }
  [[nodiscard]] double nominal_bits_per_element(index_t d) const noexcept {
    return (static_cast<double>(sketch_rows(d)) + 16.0) / d;
  }
  [[nodiscard]] float max_abs_input() const noexcept { return 2000.0f; }
  [[nodiscard]] params_type initial_params(index_t layer, index_t) const {
    const auto l = static_cast<std::uint32_t>(layer);
    return {store_.get(), l, derive_seed(seed_, l)};
  }
  /// As TurboCodec::prepare.
  void prepare(PageGeometry g, const params_type& p) const { (void)tables(g.head_dim, p); }
  [[nodiscard]] const turbo_detail::LayerTables& tables(index_t d, const params_type& p) const {
    return store_->get(d, p.layer, [&](turbo_detail::LayerTables& t) {
      t.seed = p.seed;
      t.sketch = turbo_detail::gaussian_sketch(sketch_rows(d), d, p.seed);
      t.sketch_columns = turbo_detail::transposed(t.sketch, sketch_rows(d), d);
      t.view.sketch = t.sketch.data();
      t.view.sketch_columns = t.sketch_columns.data();
      t.view.sketch_rows = sketch_rows(d);
      t.view.dim = d;
    });
  }

  void encode(PageGeometry g, const float* src, std::ptrdiff_t row_stride, const params_type& p, std::byte* dst) const {
    const turbo_detail::LayerView& v = tables(g.head_dim, p).view;
    const index_t d = g.head_dim;
    const index_t m = v.sketch_rows;
    std::fill(dst, dst + plane_bytes(g), std::byte{0});
    for (index_t t = 0; t < g.page_size; ++t) {
      const float* x = src + t * row_stride;
      double norm2 = 0.0;
      for (index_t c = 0; c < d; ++c) norm2 += static_cast<double>(x[c]) * x[c];
      std::byte* signs = dst + sign_bytes(d) * static_cast<std::size_t>(t);
      for (index_t j = 0; j < m; ++j) {
        const float* s = v.sketch + static_cast<std::size_t>(j) * d;
        double dot = 0.0;
        for (index_t c = 0; c < d; ++c) dot += static_cast<double>(s[c]) * x[c];
        if (dot >= 0.0) signs[j / 8] |= static_cast<std::byte>(1u << (j % 8));
      }
      turbo_detail::store_half(dst + norms_offset(g) + 2 * static_cast<std::size_t>(t),
                               static_cast<float>(std::sqrt(norm2)));
    }
  }

  void decode(PageGeometry g, const std::byte* plane, const params_type& p, float* dst) const {
    const turbo_detail::LayerView& v = tables(g.head_dim, p).view;
    const index_t d = g.head_dim;
    const index_t m = v.sketch_rows;
    std::vector<double> sum(static_cast<std::size_t>(d));
    for (index_t t = 0; t < g.page_size; ++t) {
      const std::byte* signs = plane + sign_bytes(d) * static_cast<std::size_t>(t);
      std::fill(sum.begin(), sum.end(), 0.0);
      for (index_t j = 0; j < m; ++j) {
        const double sign = (static_cast<unsigned>(signs[j / 8]) >> (j % 8)) & 1u ? 1.0 : -1.0;
        const float* s = v.sketch + static_cast<std::size_t>(j) * d;
        for (index_t c = 0; c < d; ++c) sum[c] += sign * s[c];
      }
      const double coef = turbo_detail::kSqrtHalfPi / m *
                          turbo_detail::load_half(plane + norms_offset(g) + 2 * static_cast<std::size_t>(t));
      for (index_t c = 0; c < d; ++c) dst[static_cast<std::size_t>(t) * d + c] = static_cast<float>(coef * sum[c]);
    }
  }

  friend bool operator==(const QjlKeyCodec& a, const QjlKeyCodec& b) noexcept {
    return a.rows_ == b.rows_ && a.seed_ == b.seed_;
  }

 private:
  index_t rows_;
  std::uint64_t seed_;
  std::shared_ptr<const turbo_detail::TableStore> store_;
};

namespace turbo_detail {
constexpr std::string_view variant_name(TurboVariant v) { return v == TurboVariant::kMse ? "mse" : "prod"; }
}  // namespace turbo_detail

/// TurboQuant at `HalfBits / 2` bits per channel (before norms): 8 = 4 bits, 7 = 3.5 (half the
/// rotated channels at 4, half at 3), 6, 5, ... Keys and values choose their variant apart.
template <int HalfBits, TurboVariant KeyVariant = TurboVariant::kMse, TurboVariant ValueVariant = TurboVariant::kMse>
struct TurboQuant {
  static_assert(HalfBits >= 2 && HalfBits <= 8, "TurboQuant rates are 1 .. 4 bits in steps of 1/2");
  using key_codec = TurboCodec<KeyVariant, Plane::kKey>;
  using value_codec = TurboCodec<ValueVariant, Plane::kValue>;
  static constexpr TurboRate kRate = HalfBits % 2 == 0 ? TurboRate::integer(HalfBits / 2)
                                                       : TurboRate::half_step(HalfBits / 2);
  key_codec key{TurboOptions{kRate}};
  value_codec value{TurboOptions{kRate}};
  static std::string name() {
    std::string rate = std::to_string(HalfBits / 2) + (HalfBits % 2 ? ".5" : "");
    return "turbo" + rate + "_" + std::string(turbo_detail::variant_name(KeyVariant)) + "_" +
           std::string(turbo_detail::variant_name(ValueVariant));
  }
  friend bool operator==(const TurboQuant&, const TurboQuant&) = default;
};

/// QJL keys (M sign bits + norm; M = 0: 2·head_dim) with TurboQuant-MSE values at
/// `ValueHalfBits / 2` bits.
template <int M = 0, int ValueHalfBits = 6>
struct QJL {
  using key_codec = QjlKeyCodec;
  using value_codec = TurboCodec<TurboVariant::kMse, Plane::kValue>;
  key_codec key{M};
  value_codec value{TurboOptions{TurboQuant<ValueHalfBits>::kRate}};
  static std::string name() {
    return "qjl" + (M > 0 ? std::to_string(M) : std::string("2d")) + "_turbo" + std::to_string(ValueHalfBits / 2) +
           (ValueHalfBits % 2 ? ".5" : "");
  }
  friend bool operator==(const QJL&, const QJL&) = default;
};

}  // namespace kvpack::inline v0::quant
