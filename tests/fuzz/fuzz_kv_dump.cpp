// libFuzzer target (clang -fsanitize=fuzzer): the K/V dump loader (eval/kv_dump.hpp) on arbitrary
// files. The input is the whole file, held in a memfd that KVDumpReader opens by its
// /proc/self/fd path (the reader takes a path). Every file must either be rejected with a
// kvpack::Error (any other exception escapes and fails the run) or load; a loaded file's size
// must be the one its header declares, and every layer must read back the file's own bytes.
// libFuzzer's malloc limit (the RSS limit, 2 GiB) fails any allocation a size field could blow up.
// Built and run by cmake/run_sanitizers.sh over the seed corpus in tests/fuzz/corpus/kv_dump.

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "fuzz/fuzz_check.hpp"
#include "kvpack/eval/kv_dump.hpp"

namespace {

/// One memfd for the whole run, rewritten per input.
int dump_fd() {
  static const int fd = [] {
    const int created = memfd_create("kvpack_fuzz_kv_dump", 0);
    FUZZ_CHECK(created >= 0);  // memfd_create
    return created;
  }();
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvpack;
  const int fd = dump_fd();
  FUZZ_CHECK(ftruncate(fd, 0) == 0);
  FUZZ_CHECK(size == 0 || pwrite(fd, data, size, 0) == static_cast<ssize_t>(size));
  const std::string path = "/proc/self/fd/" + std::to_string(fd);

  try {
    eval::KVDumpReader reader(path);
    const eval::KVDumpHeader& h = reader.header();
    FUZZ_CHECK(h.file_bytes() == size);
    const std::uint64_t n = h.layer_floats();
    for (std::uint32_t layer = 0; layer < h.layers; ++layer) {
      const eval::LayerKV kv = reader.read_layer(static_cast<index_t>(layer));
      FUZZ_CHECK(kv.tokens == static_cast<index_t>(h.tokens) && kv.kv_heads == static_cast<index_t>(h.kv_heads) &&
                 kv.head_dim == static_cast<index_t>(h.head_dim));
      FUZZ_CHECK(kv.keys.size() == n && kv.values.size() == n);
      const std::uint8_t* keys = data + eval::KVDumpHeader::kHeaderBytes + layer * 2 * n * sizeof(float);
      FUZZ_CHECK(std::memcmp(kv.keys.data(), keys, n * sizeof(float)) == 0);
      FUZZ_CHECK(std::memcmp(kv.values.data(), keys + n * sizeof(float), n * sizeof(float)) == 0);
    }
    for (const index_t bad : {index_t{-1}, static_cast<index_t>(h.layers)}) {
      bool threw = false;
      try {
        (void)reader.read_layer(bad);
      } catch (const Error& e) {
        threw = e.code() == ErrorCode::kInvalidArgument;
      }
      FUZZ_CHECK(threw);
    }
  } catch (const Error& e) {
    // Rejected: with the reason and the file's name.
    FUZZ_CHECK(e.code() == ErrorCode::kInvalidArgument);
    FUZZ_CHECK(std::string(e.what()).find(path) != std::string::npos);
  }
  return 0;
}
