// Must not compile: layout::MLA with an evictor that drops tokens (its one stream is read by
// every query head; eviction over it is not implemented). Expected: KVCache's static_assert,
// which says why. With KVPACK_COMPILE_FAIL_CONTROL the evictor keeps every token and the file
// must compile.

#include "kvpack/kvpack.hpp"

namespace kv = kvpack;

#ifdef KVPACK_COMPILE_FAIL_CONTROL
using Evictor = kv::evict::KeepAll;
#else
using Evictor = kv::evict::StreamingLLM<kv::evict::Uniform>;
#endif

static_assert(sizeof(kv::KVCache<kv::layout::MLA, kv::quant::MLA<kv::quant::Q8_0>, Evictor>) > 0);
