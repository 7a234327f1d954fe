// eval/kv_dump.hpp: round trip, and every malformed file rejected with a message naming it.

#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "kvpack/eval/kv_dump.hpp"

using namespace kvpack;
using namespace kvpack::eval;

namespace {

std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() / (std::string("kvpack_test_") + name)).string();
}

std::vector<float> iota_floats(std::size_t n, float start) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = start + 0.5f * static_cast<float>(i);
  return v;
}

}  // namespace

TEST_CASE("a kv dump reads back exactly what was written, layer by layer", "[eval][kv_dump]") {
  const std::string path = temp_path("dump_roundtrip.bin");
  const KVDumpHeader header{3, 5, 2, 4};
  {
    KVDumpWriter writer(path, header);
    for (int l = 0; l < 3; ++l) writer.write_layer(iota_floats(40, 100.0f * l), iota_floats(40, -100.0f * l));
    CHECK_THROWS_WITH(writer.write_layer(iota_floats(40, 0), iota_floats(40, 0)),
                      Catch::Contains("already written"));
  }
  CHECK(std::filesystem::file_size(path) == 28 + 3 * 2 * 40 * 4);
  KVDumpReader reader(path);
  CHECK(reader.header().tokens == 5);
  const LayerKV layer2 = reader.read_layer(2);
  const LayerKV layer0 = reader.read_layer(0);
  CHECK(layer2.keys == iota_floats(40, 200.0f));
  CHECK(layer2.values == iota_floats(40, -200.0f));
  CHECK(layer0.keys == iota_floats(40, 0.0f));
  CHECK(layer2.kv_heads == 2);
  CHECK(*layer2.key(1, 1) == 200.0f + 0.5f * 12);  // token 1, head 1 starts at element 12
  CHECK_THROWS_WITH(reader.read_layer(3), Catch::Contains("out of range"));

  // A producer that stops after one layer of three leaves the good dump at `path` as it was
  // (it truncated it when the writer was built) and no partial file behind.
  {
    KVDumpWriter interrupted(path, header);
    interrupted.write_layer(iota_floats(40, 7.0f), iota_floats(40, 7.0f));
  }
  CHECK(std::filesystem::file_size(path) == 28 + 3 * 2 * 40 * 4);
  CHECK(KVDumpReader(path).read_layer(2).keys == iota_floats(40, 200.0f));
  // io::ReplacingFile's temporaries are ".<name>.<pid>...tmp" (appended, not `"." + name`:
  // GCC 12 warns a false -Wrestrict on that operator+).
  std::string temporary_prefix(".");
  temporary_prefix.append(std::filesystem::path(path).filename().string()).append(".");
  for (const auto& entry : std::filesystem::directory_iterator(std::filesystem::path(path).parent_path())) {
    CHECK_FALSE(entry.path().filename().string().starts_with(temporary_prefix));  // no temporary left behind
  }
  CHECK_THROWS_WITH(KVDumpWriter(path, KVDumpHeader{0, 5, 2, 4}), Catch::Contains("must be positive"));
  std::filesystem::remove(path);
}

TEST_CASE("malformed kv dumps are rejected with the file's name and the reason", "[eval][kv_dump]") {
  const std::string path = temp_path("dump_bad.bin");
  CHECK_THROWS_WITH(KVDumpReader(temp_path("does_not_exist.bin")), Catch::Contains("cannot be opened"));
  {
    KVDumpWriter writer(path, {1, 2, 1, 2});
    CHECK_THROWS_WITH(writer.write_layer(iota_floats(3, 0), iota_floats(4, 0)), Catch::Contains("needs 4"));
    writer.write_layer(iota_floats(4, 0), iota_floats(4, 0));
  }
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 4);
  CHECK_THROWS_WITH(KVDumpReader(path), Catch::Contains(path) && Catch::Contains("needs exactly"));
  {
    std::ofstream f(path, std::ios::binary);
    f << "NOTADUMP and more bytes to pass the header size";
  }
  CHECK_THROWS_WITH(KVDumpReader(path), Catch::Contains("KVPKDUMP header"));
  {
    std::ofstream f(path, std::ios::binary);
    const std::uint32_t fields[5]{2, 1, 1, 1, 1};
    f.write("KVPKDUMP", 8);
    f.write(reinterpret_cast<const char*>(fields), sizeof(fields));
  }
  CHECK_THROWS_WITH(KVDumpReader(path), Catch::Contains("version 2"));
  std::filesystem::remove(path);
}

// Found by tests/fuzz/fuzz_kv_dump.cpp: 1 layer x 2^30 tokens x 2^30 heads x 4 channels needs
// 2^65 bytes, which wrapped to 0, so a bare 28-byte header passed the size check and
// read_layer(0) asked for 2^62 floats (std::length_error, not a kvpack::Error).
TEST_CASE("a kv dump header whose size does not fit in 64 bits is rejected", "[eval][kv_dump]") {
  const std::string path = temp_path("dump_huge.bin");
  auto write_header = [&](std::uint32_t layers, std::uint32_t tokens, std::uint32_t heads, std::uint32_t dim) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    const std::uint32_t fields[5]{1, layers, tokens, heads, dim};
    f.write("KVPKDUMP", 8);
    f.write(reinterpret_cast<const char*>(fields), sizeof(fields));
  };
  write_header(1, 1u << 30, 1u << 30, 4);
  CHECK_THROWS_WITH(KVDumpReader(path), Catch::Contains("needs more than 2^64"));
  write_header(2, 1u << 31, 1, 1);  // fits in 64 bits, but not in index_t
  CHECK_THROWS_WITH(KVDumpReader(path), Catch::Contains("beyond 2^31 - 1"));
  CHECK(KVDumpHeader{1, 1u << 30, 1u << 30, 4}.file_bytes() == KVDumpHeader::kTooLarge);
  CHECK(KVDumpHeader{3, 5, 2, 4}.file_bytes() == 28 + 3 * 2 * 40 * 4);
  std::filesystem::remove(path);
}
