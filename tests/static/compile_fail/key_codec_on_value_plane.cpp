// Must not compile: a Quantizer whose key codec encodes the value plane (the two planes have
// different byte layouts). Expected: KVCache's static_assert on Quantizer::key_codec.
// With KVPACK_COMPILE_FAIL_CONTROL the same file uses a key-plane codec and must compile.

#include <string>

#include "kvpack/kvpack.hpp"

namespace kv = kvpack;

namespace mock {

#ifdef KVPACK_COMPILE_FAIL_CONTROL
constexpr kv::Plane kKeyCodecPlane = kv::Plane::kKey;
#else
constexpr kv::Plane kKeyCodecPlane = kv::Plane::kValue;
#endif

struct SwappedPlanes {
  using key_codec = kv::quant::Q8_0Codec<kKeyCodecPlane>;
  using value_codec = kv::quant::Q8_0Codec<kv::Plane::kValue>;
  key_codec key{};
  value_codec value{};
  static std::string name() { return "swapped"; }
  friend bool operator==(const SwappedPlanes&, const SwappedPlanes&) = default;
};
static_assert(kv::quant::Quantizer<SwappedPlanes>, "the mock itself is a Quantizer");

}  // namespace mock

static_assert(sizeof(kv::KVCache<kv::layout::GQA, mock::SwappedPlanes>) > 0);
