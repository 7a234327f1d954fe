// Must not compile: KVCache's second argument is a codec, not a Quantizer (a key/value pair of
// codecs). Expected: the quant::Quantizer constraint on KVCache is not satisfied.
// With KVPACK_COMPILE_FAIL_CONTROL the quantizer is used instead and the file must compile.

#include "kvpack/kvpack.hpp"

namespace kv = kvpack;

#ifdef KVPACK_COMPILE_FAIL_CONTROL
using Policy = kv::quant::Q8_0;
#else
using Policy = kv::quant::Q8_0Codec<kv::Plane::kKey>;
#endif

static_assert(sizeof(kv::KVCache<kv::layout::GQA, Policy>) > 0);
