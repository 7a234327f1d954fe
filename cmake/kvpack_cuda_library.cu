// The kvpack::cuda library (cmake/KvpackCuda.cmake): the entry points of
// kvpack/backend/cuda_api.hpp, instantiated for every quantizer that header lists.
#include "kvpack/backend/cuda_api_definitions.cuh"

KVPACK_FOR_EACH_CUDA_ATTENDED(KVPACK_CUDA_INSTANTIATE_ATTEND)
KVPACK_FOR_EACH_CUDA_ENCODED(KVPACK_CUDA_INSTANTIATE_ENCODE)
