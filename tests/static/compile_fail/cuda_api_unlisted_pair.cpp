// Must not compile: the CUDA-free API (kvpack/backend/cuda_api.hpp) for a codec pair kvpack::cuda
// does not precompile (KIVI with 64-token groups), which would otherwise compile and fail to link.
// Expected: the CudaAttended constraint is not satisfied. With KVPACK_COMPILE_FAIL_CONTROL the
// pair is KIVI-4 with 32-token groups, which the library lists, and the file must compile.

#include "kvpack/backend/cuda_api.hpp"

namespace kv = kvpack;

#ifdef KVPACK_COMPILE_FAIL_CONTROL
using Policy = kv::quant::KIVI<4, 32>;
#else
using Policy = kv::quant::KIVI<4, 64>;
#endif
using K = Policy::key_codec;
using V = Policy::value_codec;

void launch(const kv::cuda_api::DeviceAttentionArgs<K, V>& args, kv::cuda_api::AttentionWorkspace& workspace) {
  kv::cuda_api::attend_paged<K, V>(args, 1, workspace);
}
