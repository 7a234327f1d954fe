// Must not compile: layout::CrossLayer over layout::MLA. The wrapper passes on neither MLA's
// latent scoring nor its query width, so a cache would attend the latent stream as GQA over the
// RoPE part. Expected: CrossLayer's static_assert, which says so. With
// KVPACK_COMPILE_FAIL_CONTROL the layers share GQA caches and the file must compile.

#include "kvpack/kvpack.hpp"

namespace kv = kvpack;

#ifdef KVPACK_COMPILE_FAIL_CONTROL
using Inner = kv::layout::GQA;
#else
using Inner = kv::layout::MLA;
#endif

static_assert(sizeof(kv::KVCache<kv::layout::CrossLayer<Inner, 2>, kv::quant::MLA<kv::quant::Q8_0>>) > 0);
