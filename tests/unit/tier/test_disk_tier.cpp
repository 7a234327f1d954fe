// DiskTier: entries survive the tier object (another one on the same directory reads them); a file
// cut short at any length, a flipped bit or an entry renamed to another key is reported as damaged
// (kInvalidArgument, with the path), never returned; stray temporaries are ignored; two writers
// of one key leave one whole entry; a directory that cannot be used is reported as kUnavailable.

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvpack/tier/disk_tier.hpp"
#include "unit/io/thrown_error.hpp"
#include "unit/tier/tier_fixture.hpp"

using namespace kvpack;
using tier::DiskTier;

namespace {

std::vector<std::byte> read_all(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> bytes(chars.size());
  std::memcpy(bytes.data(), chars.data(), chars.size());
  return bytes;
}

void write_all(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

TEST_CASE("DiskTier entries persist across tier objects on one directory", "[tier]") {
  const test::ScratchDirectory scratch("disk-persist");
  const auto a = test::pattern_bytes(100000, 1), b = test::pattern_bytes(3, 2);
  {
    DiskTier disk(scratch.path() / "nested" / "dir");  // created
    disk.put("a", a);
    disk.put("b", test::pattern_bytes(10, 9));
    disk.put("b", b);  // replaced
    disk.put("empty", {});
    CHECK(disk.stats().puts == 4);
  }
  DiskTier disk(scratch.path() / "nested" / "dir", tier::DiskTierOptions{.durable = true});
  CHECK(disk.get("a") == a);
  CHECK(disk.get("b") == b);
  CHECK(disk.get("empty") == std::vector<std::byte>{});
  CHECK_FALSE(disk.get("missing").has_value());
  CHECK(disk.erase("a"));
  CHECK_FALSE(disk.erase("a"));
  CHECK_FALSE(disk.get("a").has_value());
  disk.put("durable", a);
  CHECK(disk.get("durable") == a);
  const tier::TierStats stats = disk.stats();
  CHECK(stats.gets == 6);
  CHECK(stats.hits == 4);
  CHECK(stats.bytes_read == 2 * a.size() + b.size());
  // Only entries are left: put renamed every temporary into place.
  for (const auto& file : std::filesystem::directory_iterator(scratch.path() / "nested" / "dir")) {
    CHECK(file.path().extension() == ".kvtier");
  }
}

TEST_CASE("DiskTier reports a half-written or damaged entry instead of returning it", "[tier]") {
  const test::ScratchDirectory scratch("disk-damage");
  DiskTier disk(scratch.path());
  const auto payload = test::pattern_bytes(5000, 3);
  disk.put("entry", payload);
  const std::filesystem::path path = disk.path_of("entry");
  const std::vector<std::byte> whole = read_all(path);
  REQUIRE(whole.size() == tier::kSealBytes + payload.size());

  SECTION("cut short at any length") {
    for (const std::size_t length : {std::size_t{0}, std::size_t{7}, tier::kSealBytes - 1, tier::kSealBytes,
                                     tier::kSealBytes + 1, whole.size() / 2, whole.size() - 1}) {
      INFO("length " << length);
      write_all(path, std::span(whole).first(length));
      const auto error = test::thrown_error([&] { (void)disk.get("entry"); });
      REQUIRE(error);
      CHECK(error->code() == ErrorCode::kInvalidArgument);
      CHECK_THAT(error->what(), Catch::Contains(path.string()) && Catch::Contains("did not finish"));
    }
  }
  SECTION("a flipped bit in the payload") {
    std::vector<std::byte> flipped = whole;
    flipped[tier::kSealBytes + 1234] ^= std::byte{0x10};
    write_all(path, flipped);
    const auto error = test::thrown_error([&] { (void)disk.get("entry"); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(error->what(), Catch::Contains("checksum mismatch"));
  }
  SECTION("another key's entry") {
    std::filesystem::copy_file(path, disk.path_of("other"));
    const auto error = test::thrown_error([&] { (void)disk.get("other"); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(error->what(), Catch::Contains("stored under another key"));
  }
  SECTION("not an entry at all") {
    write_all(path, test::pattern_bytes(100, 4));
    const auto error = test::thrown_error([&] { (void)disk.get("entry"); });
    REQUIRE(error);
    CHECK_THAT(error->what(), Catch::Contains("bad magic"));
  }
  SECTION("a temporary left by a writer that died is never read") {
    write_all(scratch.path() / ".entry.999.0.tmp", std::span(whole).first(100));
    CHECK(disk.get("entry") == payload);
    disk.put("entry", test::pattern_bytes(10, 5));
    CHECK(disk.get("entry") == test::pattern_bytes(10, 5));
  }
}

TEST_CASE("DiskTier objects of one process writing one key at once leave a whole entry", "[tier]") {
  // Two tier objects on one directory (or two processes with one pid, in containers) once named
  // their temporaries alike, wrote into the same file and left an entry mixed from both.
  const test::ScratchDirectory scratch("disk-same-key");
  const auto a = test::pattern_bytes(1 << 18, 1), b = test::pattern_bytes(1 << 18, 2);
  DiskTier first(scratch.path()), second(scratch.path());
  for (int round = 0; round < 50; ++round) {
    std::thread writer([&] {
      for (int i = 0; i < 4; ++i) first.put("shared", a);
    });
    for (int i = 0; i < 4; ++i) second.put("shared", b);
    writer.join();
    const std::optional<std::vector<std::byte>> entry = second.get("shared");
    REQUIRE(entry.has_value());
    REQUIRE((*entry == a || *entry == b));
  }
  for (const auto& file : std::filesystem::directory_iterator(scratch.path())) {
    CHECK(file.path().extension() == ".kvtier");
  }
}

TEST_CASE("DiskTier on a path that is not a directory is unavailable", "[tier]") {
  const test::ScratchDirectory scratch("disk-unusable");
  std::filesystem::create_directories(scratch.path());
  write_all(scratch.path() / "file", test::pattern_bytes(1, 1));
  const auto error = test::thrown_error([&] { DiskTier disk(scratch.path() / "file"); });
  REQUIRE(error);
  CHECK(error->code() == ErrorCode::kUnavailable);
  CHECK_THAT(error->what(), Catch::Contains("is not a usable directory"));
  DiskTier disk(scratch.path());
  const auto bad_key = test::thrown_error([&] { disk.put("../escape", test::pattern_bytes(1, 1)); });
  REQUIRE(bad_key);
  CHECK(bad_key->code() == ErrorCode::kInvalidArgument);
}
