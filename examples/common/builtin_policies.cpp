// eval::builtin_policies() compiled once for this project's binaries that list policies
// (compare_policies, llama2c and the eval and example tests): each would otherwise instantiate
// every KVCache type of the registry again, minutes of the build on 2 cores. They see only the
// declaration (KVPACK_EVAL_PREBUILT_POLICIES, from the kvpack_eval_policies target); users of the
// header-only library get the inline definition.
#define KVPACK_EVAL_DEFINE_BUILTIN_POLICIES 1
#include "kvpack/eval/policies.hpp"
