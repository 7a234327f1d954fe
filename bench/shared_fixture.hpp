#pragma once
// The one fixture a bench binary keeps between benchmarks: consecutive rows of the same key
// (1 and 2 threads of one codec and context) reuse it, and a new key frees the old one before
// building its own, so two caches of hundreds of MiB never coexist.

#include <functional>
#include <memory>
#include <string>

namespace kvpack::bench {

template <class Fixture>
Fixture& shared_fixture(const std::string& key, const std::function<std::unique_ptr<Fixture>()>& make) {
  static std::unique_ptr<Fixture> fixture;
  static std::string current;
  if (current != key || fixture == nullptr) {
    fixture.reset();
    fixture = make();
    current = key;
  }
  return *fixture;
}

}  // namespace kvpack::bench
