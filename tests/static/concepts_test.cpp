/// \file concepts_test.cpp
/// \brief Concept conformance, checked at compile time: building this file is the test.
///
/// Every shipped policy satisfies its concept; mock types that break exactly one requirement (a
/// missing member or a wrong return type) do not. Each negative check has a positive twin, the
/// same mock unbroken, so a negative assert cannot pass because the mock was wrong elsewhere.

#include <cstddef>
#include <string>
#include <string_view>

#include "kvpack/kvpack.hpp"
#include "kvpack/select/quest.hpp"

// A named namespace, not an anonymous one: clang flags unused friends of internal types.
namespace kvpack::inline v0::static_tests {

// --- Shipped policies ---------------------------------------------------------------------------

static_assert(layout::Layout<layout::GQA>);

template <class Q>
constexpr bool kIsQuantizerWithCodecs = quant::Quantizer<Q> && quant::Codec<typename Q::key_codec> &&
                                        quant::Codec<typename Q::value_codec> &&
                                        Q::key_codec::kPlane == Plane::kKey &&
                                        Q::value_codec::kPlane == Plane::kValue;

static_assert(kIsQuantizerWithCodecs<quant::Float<float>>);
static_assert(kIsQuantizerWithCodecs<quant::Float<half>>);
static_assert(kIsQuantizerWithCodecs<quant::Float<bfloat16>>);
static_assert(kIsQuantizerWithCodecs<quant::FP8<quant::E4M3FN>>);
static_assert(kIsQuantizerWithCodecs<quant::FP8<quant::E5M2>>);
static_assert(kIsQuantizerWithCodecs<quant::Int8>);
static_assert(kIsQuantizerWithCodecs<quant::Q8_0>);
static_assert(kIsQuantizerWithCodecs<quant::Q4_0>);
static_assert(kIsQuantizerWithCodecs<quant::Mixed<quant::Q8_0, quant::Q4_0>>);
static_assert(kIsQuantizerWithCodecs<quant::TurboQuant<8>>);
static_assert(kIsQuantizerWithCodecs<quant::TurboQuant<5, quant::TurboVariant::kProd, quant::TurboVariant::kProd>>);
static_assert(kIsQuantizerWithCodecs<quant::QJL<>>);
static_assert(!quant::CalibratedCodec<quant::TurboQuant<6>::key_codec>);

// Mixed takes keys from its first quantizer and values from its second.
static_assert(std::is_same_v<quant::Mixed<quant::Q8_0, quant::Q4_0>::key_codec, quant::Q8_0::key_codec>);
static_assert(std::is_same_v<quant::Mixed<quant::Q8_0, quant::Q4_0>::value_codec, quant::Q4_0::value_codec>);

// Only FP8 calibrates its parameters from data.
static_assert(quant::CalibratedCodec<quant::FP8<quant::E4M3FN>::key_codec>);
static_assert(quant::CalibratedCodec<quant::FP8<quant::E4M3FN>::value_codec>);
static_assert(quant::CalibratedCodec<quant::FP8<quant::E5M2>::key_codec>);
static_assert(quant::CalibratedCodec<quant::FP8<quant::E5M2>::value_codec>);
static_assert(!quant::CalibratedCodec<quant::Int8::key_codec>);
static_assert(!quant::CalibratedCodec<quant::Int8::value_codec>);
static_assert(!quant::CalibratedCodec<quant::Q8_0::key_codec>);
static_assert(!quant::CalibratedCodec<quant::Float<float>::key_codec>);

static_assert(evict::Evictor<evict::KeepAll>);
static_assert(evict::Evictor<evict::StreamingLLM<>>);
static_assert(evict::Evictor<evict::StreamingLLM<evict::Pyramid>>);  // its default budget once did not compile
static_assert(evict::Evictor<evict::H2O<evict::Pyramid>>);
static_assert(evict::Evictor<evict::SnapKV<evict::Pyramid>>);
static_assert(evict::Budget<evict::Uniform> && evict::Budget<evict::Pyramid>);
static_assert(select::PageSelector<select::DenseRead>);
static_assert(select::PageSelector<select::Quest>);
static_assert(!evict::Evictor<select::Quest>);

// Policies are not interchangeable across axes.
static_assert(!quant::Quantizer<quant::Q8_0::key_codec>);
static_assert(!quant::Codec<quant::Q8_0>);
static_assert(!evict::Evictor<select::DenseRead>);
static_assert(!select::PageSelector<evict::KeepAll>);
static_assert(!layout::Layout<quant::Int8>);

// --- Mocks that break one requirement -----------------------------------------------------------

/// What a mock gets wrong.
enum class Break {
  kNothing,
  kMissing,     ///< one required member is absent
  kWrongType,   ///< one required member returns the wrong type
  kNotNoexcept  ///< one member required to be noexcept is not
};

template <Break B>
struct MockLayout {
  static constexpr std::string_view kName = "mock";
  void validate(const ModelShape&) const {}
  index_t streams(const ModelShape&) const noexcept { return 1; }
  index_t stream_of_query_head(const ModelShape&, index_t) const noexcept { return 0; }
  index_t key_dim(const ModelShape&) const noexcept
    requires(B == Break::kNothing)
  {
    return 32;
  }
  long key_dim(const ModelShape&) const noexcept
    requires(B == Break::kWrongType)
  {
    return 32;
  }
  index_t key_dim(const ModelShape&) const
    requires(B == Break::kNotNoexcept)
  {
    return 32;
  }
  index_t value_dim(const ModelShape&) const noexcept { return 32; }
  friend constexpr bool operator==(MockLayout, MockLayout) noexcept { return true; }
};
static_assert(layout::Layout<MockLayout<Break::kNothing>>);
static_assert(!layout::Layout<MockLayout<Break::kMissing>>);
static_assert(!layout::Layout<MockLayout<Break::kWrongType>>);
static_assert(!layout::Layout<MockLayout<Break::kNotNoexcept>>);

template <Plane P, Break B = Break::kNothing>
struct MockCodec {
  using params_type = quant::NoParams;
  static constexpr std::string_view kName = "mock";
  static constexpr Plane kPlane = P;
  void validate(quant::PageGeometry) const {}
  std::size_t plane_bytes(quant::PageGeometry) const noexcept
    requires(B != Break::kWrongType)
  {
    return 0;
  }
  int plane_bytes(quant::PageGeometry) const noexcept
    requires(B == Break::kWrongType)
  {
    return 0;
  }
  double nominal_bits_per_element(index_t) const noexcept { return 8.0; }
  float max_abs_input() const noexcept { return 1.0f; }
  params_type initial_params(index_t, index_t) const { return {}; }
  void encode(quant::PageGeometry, const float*, std::ptrdiff_t, const params_type&, std::byte*) const {}
  void decode(quant::PageGeometry, const std::byte*, const params_type&, float*) const
    requires(B != Break::kMissing)
  {}
  friend constexpr bool operator==(MockCodec, MockCodec) noexcept { return true; }
};
static_assert(quant::Codec<MockCodec<Plane::kKey>>);
static_assert(!quant::Codec<MockCodec<Plane::kKey, Break::kMissing>>);
static_assert(!quant::Codec<MockCodec<Plane::kKey, Break::kWrongType>>);
static_assert(!quant::CalibratedCodec<MockCodec<Plane::kKey>>);

/// A calibrated mock: the plain mock plus the calibration members (one of them broken).
template <Break B>
struct MockCalibratedCodec : MockCodec<Plane::kKey> {
  quant::ScaleGranularity granularity() const noexcept { return quant::ScaleGranularity::kPerTensor; }
  bool calibrates() const noexcept { return true; }
  params_type params_from_absmax(float) const noexcept
    requires(B == Break::kNothing)
  {
    return {};
  }
  float params_from_absmax(float) const noexcept
    requires(B == Break::kWrongType)
  {
    return 1.0f;
  }
};
static_assert(quant::CalibratedCodec<MockCalibratedCodec<Break::kNothing>>);
static_assert(!quant::CalibratedCodec<MockCalibratedCodec<Break::kMissing>>);
static_assert(!quant::CalibratedCodec<MockCalibratedCodec<Break::kWrongType>>);

template <Break B, class KeyCodec = MockCodec<Plane::kKey>>
struct MockQuantizer {
  using key_codec = KeyCodec;
  using value_codec = MockCodec<Plane::kValue>;
  key_codec key{};
  value_codec value{};
  static std::string name()
    requires(B != Break::kWrongType)
  {
    return "mock";
  }
  static int name()
    requires(B == Break::kWrongType)
  {
    return 0;
  }
  friend constexpr bool operator==(const MockQuantizer&, const MockQuantizer&) noexcept { return true; }
};
/// A quantizer without a `value` member.
struct MockQuantizerNoValue {
  using key_codec = MockCodec<Plane::kKey>;
  using value_codec = MockCodec<Plane::kValue>;
  key_codec key{};
  static std::string name() { return "mock"; }
  friend constexpr bool operator==(const MockQuantizerNoValue&, const MockQuantizerNoValue&) noexcept {
    return true;
  }
};
static_assert(quant::Quantizer<MockQuantizer<Break::kNothing>>);
static_assert(!quant::Quantizer<MockQuantizerNoValue>);
static_assert(!quant::Quantizer<MockQuantizer<Break::kWrongType>>);
// A quantizer is only as good as its codecs.
static_assert(!quant::Quantizer<MockQuantizer<Break::kNothing, MockCodec<Plane::kKey, Break::kMissing>>>);

template <Break B>
struct MockEvictor {
  static constexpr std::string_view kName = "mock";
  static constexpr bool kNeedsScores = false;
};
template <>
struct MockEvictor<Break::kNothing> : MockEvictor<Break::kMissing> {
  static constexpr bool kDropsTokens = false;
};
template <>
struct MockEvictor<Break::kWrongType> : MockEvictor<Break::kMissing> {
  static constexpr std::string_view kDropsTokens = "no";
};
static_assert(evict::Evictor<MockEvictor<Break::kNothing>>);
// An evictor that drops tokens must also say how many to keep and which.
struct MockDroppingEvictorWithoutChoice : MockEvictor<Break::kMissing> {
  static constexpr bool kDropsTokens = true;
  static constexpr bool kUsesObservation = false;
  static constexpr bool kEvictsOnAppend = true;
};
static_assert(!evict::Evictor<MockDroppingEvictorWithoutChoice>);
static_assert(!evict::Evictor<MockEvictor<Break::kMissing>>);
static_assert(!evict::Evictor<MockEvictor<Break::kWrongType>>);

template <Break B>
struct MockSelector {
  static constexpr std::string_view kName = "mock";
  static constexpr bool kReadsAllPages = true;
  std::size_t summary_bytes(index_t, index_t) const noexcept
    requires(B == Break::kNothing)
  {
    return 0;
  }
  int summary_bytes(index_t, index_t) const noexcept
    requires(B == Break::kWrongType)
  {
    return 0;
  }
  std::size_t summary_bytes(index_t, index_t) const
    requires(B == Break::kNotNoexcept)
  {
    return 0;
  }
};
static_assert(select::PageSelector<MockSelector<Break::kNothing>>);
static_assert(!select::PageSelector<MockSelector<Break::kMissing>>);
static_assert(!select::PageSelector<MockSelector<Break::kWrongType>>);
static_assert(!select::PageSelector<MockSelector<Break::kNotNoexcept>>);

// --- The cache accepts every shipped combination ------------------------------------------------

static_assert(sizeof(KVCache<layout::GQA, quant::Float<float>>) > 0);
static_assert(sizeof(KVCache<layout::GQA, quant::FP8<quant::E4M3FN>, evict::KeepAll, select::DenseRead>) > 0);
static_assert(sizeof(KVCache<layout::GQA, quant::Mixed<quant::Q8_0, quant::Q4_0>>) > 0);
static_assert(sizeof(KVCache<MockLayout<Break::kNothing>, MockQuantizer<Break::kNothing>,
                             MockEvictor<Break::kNothing>, MockSelector<Break::kNothing>>) > 0);

}  // namespace kvpack::inline v0::static_tests
