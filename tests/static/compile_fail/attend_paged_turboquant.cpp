// Must not compile: a raw paged launch (kernels::attend_paged) over TurboQuant pages, whose
// rotations the launch arguments do not carry. Expected: the PagedAttendable constraint on
// attend_paged is not satisfied. With KVPACK_COMPILE_FAIL_CONTROL the pages are q4_0's and the
// file must compile.

#include "kvpack/kernels/attend_paged.hpp"
#include "kvpack/kvpack.hpp"

namespace kv = kvpack;

#ifdef KVPACK_COMPILE_FAIL_CONTROL
using Policy = kv::quant::Q4_0;
#else
using Policy = kv::quant::TurboQuant<4>;
#endif
using K = Policy::key_codec;
using V = Policy::value_codec;

void launch(const kv::kernels::PagedArgs<K, V>& args, kv::kernels::PagedWorkspace& workspace) {
  kv::kernels::attend_paged<K, V>(args, 1, workspace);
}
