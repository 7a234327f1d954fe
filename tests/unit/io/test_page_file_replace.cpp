// write_page_file to a path replaces a regular file whole: a write that fails leaves the old file
// as it was, a reader that has it mapped keeps the old bytes, its permissions are kept, no
// temporary is left behind; a symbolic link or a named pipe is written in place. Durable writes
// (fsync) go through on files, links and pipes alike.

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "kvpack/io/page_file.hpp"
#include "kvpack/kvpack.hpp"
#include "unit/io/page_file_fixture.hpp"
#include "unit/io/thrown_error.hpp"
#include "unit/tier/tier_fixture.hpp"

using namespace kvpack;
using Cache = KVCache<layout::GQA, quant::Q8_0>;

namespace {

std::vector<std::byte> file_bytes(const std::filesystem::path& path) {
  const io::MappedFile file(path.string());
  return {file.bytes().begin(), file.bytes().end()};
}

/// The directory's entries other than `keep`.
std::vector<std::string> others(const std::filesystem::path& directory, std::string_view keep) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(directory)) {
    if (entry.path().filename() != keep) names.push_back(entry.path().filename().string());
  }
  return names;
}

}  // namespace

TEST_CASE("write_page_file replaces a file whole or not at all", "[io][page_file]") {
  test::ScratchDirectory scratch("page-file-replace");
  std::filesystem::create_directories(scratch.path());
  const std::filesystem::path path = scratch.path() / "seq.kvpages";
  Cache cache(test::kPageFileShape);
  const SeqId first = test::fill_sequence(cache, 7);
  const SeqId second = test::fill_sequence(cache, 8);
  const std::vector<std::byte> first_bytes = io::write_page_file(cache, first);
  const std::vector<std::byte> second_bytes = io::write_page_file(cache, second);
  REQUIRE(first_bytes != second_bytes);
  io::write_page_file(path.string(), cache, first);
  REQUIRE(file_bytes(path) == first_bytes);

  SECTION("a write the writer refuses leaves the old file") {
    CacheConfig config;
    config.tail_tokens = 32;
    Cache with_tail(test::kPageFileShape, config);
    const SeqId seq = test::fill_sequence(with_tail);
    const auto error = test::thrown_error([&] { io::write_page_file(path.string(), with_tail, seq); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kUnsupported);
    CHECK(file_bytes(path) == first_bytes);
    CHECK(others(scratch.path(), "seq.kvpages").empty());
  }
  SECTION("a reader that has the old file mapped keeps reading it") {
    const io::MappedFile mapped(path.string());
    io::write_page_file(path.string(), cache, second);
    CHECK(std::equal(mapped.bytes().begin(), mapped.bytes().end(), first_bytes.begin(), first_bytes.end()));
    CHECK(file_bytes(path) == second_bytes);
    CHECK(others(scratch.path(), "seq.kvpages").empty());
  }
  SECTION("the replaced file keeps its permissions") {
    std::filesystem::permissions(path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
    io::write_page_file(path.string(), cache, second);
    CHECK(file_bytes(path) == second_bytes);
    CHECK(std::filesystem::status(path).permissions() ==
          (std::filesystem::perms::owner_read | std::filesystem::perms::owner_write));
  }
  SECTION("a symbolic link is written through, in place") {
    const std::filesystem::path link = scratch.path() / "latest";
    std::filesystem::create_symlink(path.filename(), link);
    io::write_page_file(link.string(), cache, second);
    CHECK(std::filesystem::is_symlink(link));
    CHECK(file_bytes(path) == second_bytes);
  }
  SECTION("durable writes fsync a new file, a replaced one and a link's target") {
    io::PageFileOptions durable;
    durable.durable = true;
    io::write_page_file((scratch.path() / "new.kvpages").string(), cache, second, durable);
    CHECK(file_bytes(scratch.path() / "new.kvpages") == second_bytes);
    io::write_page_file(path.string(), cache, second, durable);
    CHECK(file_bytes(path) == second_bytes);
    const std::filesystem::path link = scratch.path() / "latest";
    std::filesystem::create_symlink(path.filename(), link);
    io::write_page_file(link.string(), cache, first, durable);
    CHECK(file_bytes(path) == first_bytes);
  }
  SECTION("a named pipe is written in place, durable or not (a pipe has nothing to fsync)") {
    io::PageFileOptions options;
    options.durable = GENERATE(false, true);
    const std::filesystem::path pipe = scratch.path() / "pipe";
    REQUIRE(::mkfifo(pipe.c_str(), 0600) == 0);
    std::vector<std::byte> received;
    std::thread reader([&] {
      const int fd = ::open(pipe.c_str(), O_RDONLY | O_CLOEXEC);
      std::byte buffer[65536];
      for (ssize_t n; fd >= 0 && (n = ::read(fd, buffer, sizeof buffer)) > 0;) {
        received.insert(received.end(), buffer, buffer + n);
      }
      if (fd >= 0) ::close(fd);
    });
    io::write_page_file(pipe.string(), cache, second, options);
    reader.join();
    CHECK(received == second_bytes);
    CHECK(others(scratch.path(), "seq.kvpages") == std::vector<std::string>{"pipe"});
  }
}
