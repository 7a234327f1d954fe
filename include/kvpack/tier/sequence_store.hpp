#pragma once
/// \file sequence_store.hpp
/// \brief A cached sequence's K/V in a tier: store_sequence puts its page file there under a key
///        made from everything that decides its bytes, fetch_sequence loads it back into a cache
///        (verified byte for byte by io::load_page_file), and fetch_or_recompute falls back to
///        the caller's prefill whenever fetching is not possible or not worth it — a server that
///        is down, a damaged entry, a miss — and says which happened and why.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"
#include "kvpack/io/page_file.hpp"
#include "kvpack/paging/fingerprint.hpp"
#include "kvpack/tier/cache_identity.hpp"
#include "kvpack/tier/fetch_planner.hpp"
#include "kvpack/tier/tier.hpp"

namespace kvpack::inline v0::tier {

/// The tier key of a sequence: "kvpack-" and 32 hex digits, two independent 64-bit fingerprints
/// of the cache's identity (cache_identity.hpp) and the token ids. Keys only find
/// entries; fetch_sequence still checks the tokens, and the loader every page byte, so a
/// collision costs a recompute, never a wrong page. Stable across runs of builds on
/// little-endian hosts (the fingerprint hashes object bytes).
template <class Cache>
[[nodiscard]] std::string sequence_key(const Cache& cache, std::span<const std::int32_t> tokens,
                                       std::string_view model_id, std::string_view salt = {}) {
  const auto fingerprint = [&](std::uint64_t seed) {
    paging::Fingerprint f(seed);
    add_cache_identity(f, cache, model_id, salt);
    f.add(tokens);
    return f.value();
  };
  char text[40];
  std::snprintf(text, sizeof text, "kvpack-%016llx%016llx", static_cast<unsigned long long>(fingerprint(1)),
                static_cast<unsigned long long>(fingerprint(2)));
  return text;
}

/// Writes sequence `seq`'s page file, with its token ids and `model_id`, to `tier` under `key`.
/// \returns the entry's size in bytes
/// \throws kvpack::Error as io::write_page_file and Tier::put
template <class Cache>
std::size_t store_sequence(Tier& tier, std::string_view key, const Cache& cache, SeqId seq,
                           std::span<const std::int32_t> tokens, std::string_view model_id) {
  const std::vector<std::byte> file =
      io::write_page_file(cache, seq, io::PageFileOptions{std::string(model_id), tokens});
  tier.put(key, file);
  return file.size();
}

/// Loads the entry under `key` into `cache` as a new sequence; nullopt when the tier has none.
/// `check` is what the loader verifies of each page (io::load_page_file): kReencode for a tier
/// others may write to, kStructure to restore at copy speed from one only kvpack caches write.
/// \throws kvpack::Error kInvalidArgument when the entry holds other tokens than `tokens` or is
///         damaged; kUnavailable when the tier cannot be read; the loader's errors (kUnsupported
///         for a cache it cannot fill, OutOfPages). The cache holds no new sequence and no new
///         page whenever it throws; a layer that took the file's codec parameters on the way
///         (FP8 calibrated from its first pages) keeps them, as io::load_page_file says.
template <class Cache>
[[nodiscard]] std::optional<SeqId> fetch_sequence(Tier& tier, std::string_view key, Cache& cache,
                                                  std::span<const std::int32_t> tokens,
                                                  PageCheck check = PageCheck::kReencode) {
  const std::optional<std::vector<std::byte>> file = tier.get(key);
  if (!file) return std::nullopt;
  const std::string what = tier.describe() + " entry '" + std::string(key) + "'";
  const io::PageFileView view = io::PageFileView::parse(*file, what);
  const std::span<const std::int32_t> stored = view.tokens();
  KVPACK_CHECK(std::equal(stored.begin(), stored.end(), tokens.begin(), tokens.end()), kInvalidArgument,
               detail::message(what, " holds another token sequence (", stored.size(), " tokens, ", tokens.size(),
                               " asked for)"));
  return io::load_page_file(cache, view, check);
}

/// How a sequence came back.
struct Restored {
  SeqId seq{};
  bool fetched = false;        ///< true: from the tier; false: the caller's recompute ran
  std::string why_recomputed;  ///< empty when fetched
};

/// The sequence under `key` in `cache`: fetched from `tier` when `plan` (if given) says fetching
/// pays, recomputed by `recompute()` (which returns the new SeqId) otherwise, and also when the
/// tier has no entry, cannot be reached, or holds an entry that is damaged or does not fit this
/// cache. Errors from `recompute`, and OutOfPages from the fetch, reach the caller. `check` as
/// in fetch_sequence.
template <class Cache, class Recompute>
[[nodiscard]] Restored fetch_or_recompute(Tier& tier, std::string_view key, Cache& cache,
                                          std::span<const std::int32_t> tokens, Recompute&& recompute,
                                          const FetchPlan* plan = nullptr, PageCheck check = PageCheck::kReencode) {
  Restored result;
  if (plan != nullptr && !plan->fetch) {
    result.why_recomputed = detail::message("the planner expects a recompute in ", plan->recompute_s,
                                            " s against a fetch in ", plan->fetch_s, " s");
  } else {
    try {
      if (const std::optional<SeqId> seq = fetch_sequence(tier, key, cache, tokens, check)) {
        result.seq = *seq;
        result.fetched = true;
        return result;
      }
      result.why_recomputed = detail::message("no entry '", std::string(key), "' in ", tier.describe());
    } catch (const Error& error) {
      if (error.code() == ErrorCode::kOutOfPages) throw;  // a recompute needs the same pages
      result.why_recomputed = error.what();
    }
  }
  result.seq = recompute();
  return result;
}

}  // namespace kvpack::inline v0::tier
