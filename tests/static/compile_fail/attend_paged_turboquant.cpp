// Must not compile: a raw paged launch (kernels::attend_paged) over QJL key pages, whose sketch
// the device kernels do not apply (TurboQuant-MSE pages are accepted: their launches carry the
// rotation). Expected: the PagedAttendable constraint on attend_paged is not satisfied. With
// KVPACK_COMPILE_FAIL_CONTROL the pages are TurboQuant-MSE's and the file must compile.

#include "kvpack/kernels/attend_paged.hpp"
#include "kvpack/kvpack.hpp"

namespace kv = kvpack;

#ifdef KVPACK_COMPILE_FAIL_CONTROL
using Policy = kv::quant::TurboQuant<4>;
#else
using Policy = kv::quant::QJL<>;
#endif
using K = Policy::key_codec;
using V = Policy::value_codec;

void launch(const kv::kernels::PagedArgs<K, V>& args, kv::kernels::PagedWorkspace& workspace) {
  kv::kernels::attend_paged<K, V>(args, 1, workspace);
}
