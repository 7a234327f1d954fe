#pragma once
/// \file prefix_index.hpp
/// \brief PrefixIndex: which pages already hold the K/V of a token prefix, for every (layer, KV
///        stream) of a cache, so a new sequence reuses them and prefills only the rest.
///
/// **Structure: a trie of whole pages with a hashed child table.** Each node is one page of
/// `page_size` token ids under its parent; it keeps those tokens, its parent, and for every stream
/// the PageId holding that page's K/V with one pool reference on it. A child is found by hashing
/// (parent, tokens) into an open-addressing table and then comparing the parent and all the
/// tokens, so equal hashes never serve another prompt's K/V.
///
/// Why not vLLM's hash chain (a block named by H(parent hash, tokens, extras)): it trusts the hash
/// (sha256), and checking a chained hash without trusting it needs every earlier block's tokens;
/// a node that knows its parent is checked with one page of tokens. The tree also gives eviction
/// its order for free: leaves are the pages nothing else extends, so evicting least-recently-used
/// *leaves* frees a sequence's tail pages before the shared prefix they hang off (vLLM gets the
/// same by queueing a finished request's blocks in reverse). Why not a radix tree with
/// variable-length edges (SGLang): only whole pages can be shared, so an edge of exactly one page
/// loses nothing and keeps one node = one unit of pinning and eviction.
///
/// **Keys.** Every root is a PrefixKey (model, layout, shape, page size, codec and a fingerprint of
/// its parameters, cache options, salt), compared field by field: pages of caches that differ in
/// any of them never meet.
///
/// **References.** The index holds one pool reference on each page of each node (the pool's retain
/// at insert, release at eviction). Callers that keep page ids in their own tables hold their own
/// references, as fork does; a page whose count is above 1 is shared, so a cache copies it before
/// changing it. A PrefixLease pins a node and so its whole path (a node with children is never
/// evicted); eviction takes only unpinned leaves, least recently used first, and a page returns to
/// the pool only when no sequence holds it either.
///
/// Thread-safe: one mutex around every call (the work per call is small next to a prefill).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"
#include "kvpack/paging/detail/indexed_min_heap.hpp"
#include "kvpack/paging/detail/node_hash_table.hpp"
#include "kvpack/paging/fingerprint.hpp"
#include "kvpack/paging/page_references.hpp"
#include "kvpack/paging/prefix_key.hpp"

namespace kvpack::inline v0::paging {

class PrefixIndex;

/// Pins a cached path (the pages matched or inserted) against eviction until reset or destroyed.
/// Move-only; share() pins the same path again (a fork). It must not outlive its index.
class PrefixLease {
 public:
  PrefixLease() noexcept = default;
  PrefixLease(PrefixLease&& other) noexcept
      : index_(std::exchange(other.index_, nullptr)),
        node_(other.node_),
        pages_(std::exchange(other.pages_, 0)) {}
  PrefixLease& operator=(PrefixLease&& other) noexcept {
    if (this != &other) {
      reset();
      index_ = std::exchange(other.index_, nullptr);
      node_ = other.node_;
      pages_ = std::exchange(other.pages_, 0);
    }
    return *this;
  }
  PrefixLease(const PrefixLease&) = delete;
  PrefixLease& operator=(const PrefixLease&) = delete;
  ~PrefixLease() { reset(); }

  /// Unpins; the path's unreferenced leaves become evictable.
  void reset() noexcept;
  /// Another lease on the same path (empty if this one is).
  [[nodiscard]] PrefixLease share() const;

  [[nodiscard]] bool empty() const noexcept { return index_ == nullptr; }
  /// Whole pages the pinned path covers from the first token.
  [[nodiscard]] std::size_t pages() const noexcept { return pages_; }

 private:
  friend class PrefixIndex;
  PrefixLease(PrefixIndex* index, std::uint32_t node, std::size_t pages) noexcept
      : index_(index), node_(node), pages_(pages) {}

  PrefixIndex* index_ = nullptr;
  std::uint32_t node_ = 0;
  std::size_t pages_ = 0;
};

/// What match() found: the longest cached prefix in whole pages and its page ids.
struct PrefixMatch {
  std::size_t pages = 0;    ///< whole pages matched from the first token
  std::size_t tokens = 0;   ///< pages × page_size
  std::size_t streams = 0;  ///< page ids per page
  /// [pages][streams]. Borrowed: they stay valid while `lease` is held; a caller that keeps them
  /// in its own tables retains each one (PagePool::retain) and releases it when done.
  std::vector<PageId> page_ids;
  PrefixLease lease;  ///< pins the matched path; empty when nothing matched

  /// The page ids of page `p`, one per stream.
  [[nodiscard]] std::span<const PageId> page(std::size_t p) const noexcept {
    return std::span<const PageId>(page_ids).subspan(p * streams, streams);
  }
};

/// Counters since construction and sizes now. A "token page" is page_size tokens (one node) and
/// covers every stream; a "pool page" is one stream's page of it.
struct PrefixIndexStats {
  std::uint64_t lookups = 0;        ///< match() calls
  std::uint64_t lookup_tokens = 0;  ///< tokens passed to match()
  std::uint64_t hit_tokens = 0;     ///< of them, tokens found cached (whole pages)
  std::uint64_t hit_pages = 0;      ///< token pages match() found
  /// Pool pages callers reused instead of prefilling: hit_pages × streams
  std::uint64_t pages_saved = 0;
  std::uint64_t inserted_pages = 0;  ///< token pages insert() added
  std::uint64_t evicted_pages = 0;   ///< token pages evict_unreferenced() dropped
  std::size_t cached_pages = 0;      ///< token pages held now
  /// Pool pages the index references now: cached_pages × streams
  std::size_t cached_pool_pages = 0;
  /// Their payload and metadata bytes (live sequences may share them)
  std::size_t cached_page_bytes = 0;
  /// Unpinned leaves: first in line for eviction (their parents follow)
  std::size_t evictable_pages = 0;
  std::size_t namespaces = 0;  ///< distinct PrefixKeys with cached pages
  /// The index's own memory, not the pages': node records, token copies, page ids, the child
  /// table and LRU heap (exact capacities), the key map (its nodes at libstdc++'s size).
  std::size_t index_bytes = 0;

  /// hit_tokens / lookup_tokens; 0 before any lookup.
  [[nodiscard]] double hit_rate() const noexcept {
    return lookup_tokens == 0
               ? 0.0
               : static_cast<double>(hit_tokens) / static_cast<double>(lookup_tokens);
  }
};

/// What one evict_unreferenced() call did.
struct PrefixEviction {
  std::size_t token_pages = 0;  ///< nodes dropped
  std::size_t pool_refs = 0;    ///< pool references released: token_pages × streams
  /// Of them, pages that went back to the pool (no other holder), as the index saw them: a
  /// holder releasing the same page at the same moment may free it uncounted (never the reverse).
  std::size_t pool_pages_freed = 0;
};

struct PrefixIndexOptions {
  using BlockHash = std::uint64_t (*)(std::span<const TokenId>) noexcept;
  /// Hash of one page of token ids. Tests pass a constant to force collisions.
  BlockHash block_hash = &hash_token_block;
};

class PrefixIndex {
 public:
  /// Evict everything that is not pinned.
  static constexpr std::size_t kAllPages = std::numeric_limits<std::size_t>::max();

  /// \param pool the pool the pages come from (PagePool, the device's pool); must outlive the
  ///        index
  /// \param page_size tokens per page (the cache's CacheConfig::page_size)
  /// \param streams page ids per token page: every (cache layer, KV stream) of the cache
  template <ReferenceCountedPool Pool>
  PrefixIndex(Pool& pool, index_t page_size, std::size_t streams, PrefixIndexOptions options = {})
      : pool_(pool),
        page_size_(static_cast<std::size_t>(page_size)),
        streams_(streams),
        block_hash_(options.block_hash) {
    KVPACK_CHECK(page_size > 0, kInvalidConfig,
                 detail::message("PrefixIndex page_size must be > 0, got ", page_size));
    KVPACK_CHECK(streams > 0, kInvalidConfig, "PrefixIndex needs at least one stream per page");
    KVPACK_CHECK(block_hash_ != nullptr, kInvalidConfig,
                 "PrefixIndexOptions.block_hash must be set");
  }

  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  /// Releases the index's reference on every cached page. Every lease must be gone by now.
  ~PrefixIndex() {
    for (std::uint32_t id = 0; id < nodes_.size(); ++id) {
      if (!nodes_[id].alive || nodes_[id].root_key != nullptr) continue;
      for (PageId page : pages_of(id)) pool_.release(page);
    }
  }

  [[nodiscard]] index_t page_size() const noexcept { return static_cast<index_t>(page_size_); }
  [[nodiscard]] std::size_t streams() const noexcept { return streams_; }

  /// The longest cached prefix of `tokens` under `key`, in whole pages (a partial last page never
  /// matches), with its page ids and a lease pinning it; counts in the statistics and marks the
  /// path used. An engine that needs the last prompt token's logits passes all tokens but the last.
  /// \throws kvpack::Error(kInvalidArgument) for a key with an empty field or another page size
  [[nodiscard]] PrefixMatch match(const PrefixKey& key, std::span<const TokenId> tokens) {
    check_key(key);
    std::lock_guard lock(mutex_);
    const std::size_t found = find_path(key, tokens);
    PrefixMatch result;
    result.streams = streams_;
    result.page_ids.resize(found * streams_);  // the last allocation: before any change
    for (std::size_t p = 0; p < found; ++p) {
      const auto ids = pages_of(path_[p]);
      std::copy(ids.begin(), ids.end(),
                result.page_ids.begin() + static_cast<std::ptrdiff_t>(p * streams_));
    }
    ++clock_;
    if (found > 0) {
      pin(path_.back());  // out of the LRU heap before its key changes
      for (std::uint32_t id : path_) nodes_[id].last_use = clock_;
      result.lease = PrefixLease(this, path_.back(), found);
    }
    result.pages = found;
    result.tokens = found * page_size_;
    ++stats_.lookups;
    stats_.lookup_tokens += tokens.size();
    stats_.hit_tokens += result.tokens;
    stats_.hit_pages += found;
    stats_.pages_saved += found * streams_;
    return result;
  }

  /// The pages match() would find, without pinning, statistics or marking anything used.
  [[nodiscard]] std::size_t cached_prefix_pages(const PrefixKey& key,
                                                std::span<const TokenId> tokens) const {
    check_key(key);
    std::lock_guard lock(mutex_);
    return find_path(key, tokens);
  }

  /// Caches a sequence's whole pages: `tokens` (a multiple of page_size) and their page ids,
  /// [pages][streams], pages of this index's pool that the caller holds. Pages already cached
  /// keep their ids (the caller's duplicates are not referenced); new ones get an index reference
  /// each (the pool's retain). Returns a lease on the whole path. All or nothing: on an exception
  /// nothing changed.
  /// \throws kvpack::Error(kInvalidArgument) for a bad key, a partial page, or a page-id count
  ///         other than pages × streams
  PrefixLease insert(const PrefixKey& key, std::span<const TokenId> tokens,
                     std::span<const PageId> pages) {
    check_key(key);
    KVPACK_CHECK(tokens.size() % page_size_ == 0, kInvalidArgument,
                 detail::message("PrefixIndex::insert takes whole pages: ", tokens.size(),
                                 " tokens is not a multiple of page_size ", page_size_,
                                 " (pass the full pages only; a partial page is never shared)"));
    const std::size_t count = tokens.size() / page_size_;
    KVPACK_CHECK(
        pages.size() == count * streams_, kInvalidArgument,
        detail::message("PrefixIndex::insert: ", count, " pages of ", streams_, " streams need ",
                        count * streams_, " page ids, got ", pages.size()));
    std::lock_guard lock(mutex_);
    if (count == 0) return {};
    auto ns = namespaces_.find(key);
    std::uint32_t node = kNone;
    std::size_t depth = 0;
    if (ns != namespaces_.end()) {
      node = ns->second;
      for (; depth < count; ++depth) {
        const std::uint32_t child = find_child(node, block(tokens, depth));
        if (child == kNone) break;
        node = child;
      }
    }
    // Reserve everything first, so that what follows cannot throw.
    const bool new_root = ns == namespaces_.end();
    reserve_nodes(count - depth + (new_root ? 1 : 0));
    if (new_root) {
      ns = namespaces_.emplace(key, kNone).first;
      node = new_node();
      nodes_[node].root_key = &ns->first;
      ns->second = node;
    }
    ++clock_;
    if (heap_.contains(node)) heap_.erase(node, lru_less());  // it gains a child or a pin
    for (std::uint32_t up = node; up != kNone; up = nodes_[up].parent) nodes_[up].last_use = clock_;
    for (std::size_t p = depth; p < count; ++p) {
      const std::uint32_t child = new_node();
      Node& n = nodes_[child];
      const auto ids = pages.subspan(p * streams_, streams_);
      const auto block_tokens = block(tokens, p);
      n.parent = node;
      n.child_key = child_key(node, block_hash_(block_tokens));
      n.last_use = clock_;
      std::copy(block_tokens.begin(), block_tokens.end(), tokens_of(child).begin());
      std::copy(ids.begin(), ids.end(), pages_of(child).begin());
      for (PageId id : ids) pool_.retain(id);
      children_.insert(child, n.child_key);
      ++nodes_[node].children;
      node = child;
    }
    pin(node);
    stats_.inserted_pages += count - depth;
    return PrefixLease(this, node, count);
  }

  /// Drops unpinned leaves, least recently used first, until `pool_pages_needed` pages went back
  /// to the pool or nothing unpinned is left. A parent whose last child goes becomes a leaf and
  /// joins the order at its own age. Pages a sequence still holds stay allocated (only the
  /// index's reference goes).
  PrefixEviction evict_unreferenced(std::size_t pool_pages_needed) {
    std::lock_guard lock(mutex_);
    PrefixEviction done;
    while (done.pool_pages_freed < pool_pages_needed && !heap_.empty()) {
      const std::uint32_t id = heap_.top();
      heap_.erase(id, lru_less());
      drop_leaf(id, done);
    }
    stats_.evicted_pages += done.token_pages;
    return done;
  }

  [[nodiscard]] PrefixIndexStats stats() const {
    std::lock_guard lock(mutex_);
    PrefixIndexStats s = stats_;
    s.cached_pages = cached_nodes_ - namespaces_.size();  // every namespace has one root node
    s.cached_pool_pages = s.cached_pages * streams_;
    s.cached_page_bytes = s.cached_pool_pages * pool_.page_bytes();
    s.evictable_pages = heap_.size();
    s.namespaces = namespaces_.size();
    s.index_bytes = nodes_.capacity() * sizeof(Node) + tokens_.capacity() * sizeof(TokenId) +
                    pages_.capacity() * sizeof(PageId) +
                    free_nodes_.capacity() * sizeof(std::uint32_t) +
                    path_.capacity() * sizeof(std::uint32_t) + children_.bytes() + heap_.bytes() +
                    namespaces_.bucket_count() * sizeof(void*);
    for (const auto& [key, root] : namespaces_) {
      s.index_bytes += sizeof(std::pair<const PrefixKey, std::uint32_t>) + 2 * sizeof(void*) +
                       key.model_id.capacity() + key.layout.capacity() + key.codec.capacity() +
                       key.salt.capacity();
    }
    return s;
  }

 private:
  friend class PrefixLease;
  static constexpr std::uint32_t kNone = detail::NodeHashTable::kNone;

  struct Node {
    std::uint32_t parent = kNone;
    std::uint32_t children = 0;
    std::uint32_t pins = 0;               // leases on this node
    std::uint64_t child_key = 0;          // its hash in children_: (parent, block hash)
    std::uint64_t last_use = 0;           // clock_ of the last match or insert through it
    const PrefixKey* root_key = nullptr;  // roots only: their key in namespaces_ (node-stable)
    bool alive = false;
  };

  // Older first. No two leaves share an age: each match or insert touches one path, which has
  // one leaf (a sequence's tail goes before its prefix because only leaves are evicted).
  struct LruLess {
    const std::vector<Node>* nodes;
    bool operator()(std::uint32_t a, std::uint32_t b) const noexcept {
      return (*nodes)[a].last_use < (*nodes)[b].last_use;
    }
  };

  void check_key(const PrefixKey& key) const {
    key.validate();
    KVPACK_CHECK(static_cast<std::size_t>(key.page_size) == page_size_, kInvalidArgument,
                 detail::message("PrefixKey.page_size (", key.page_size,
                                 ") differs from the index's (", page_size_, ")"));
  }

  [[nodiscard]] std::span<const TokenId> block(std::span<const TokenId> tokens,
                                               std::size_t p) const noexcept {
    return tokens.subspan(p * page_size_, page_size_);
  }
  [[nodiscard]] std::span<TokenId> tokens_of(std::uint32_t id) noexcept {
    return std::span<TokenId>(tokens_).subspan(id * page_size_, page_size_);
  }
  [[nodiscard]] std::span<const TokenId> tokens_of(std::uint32_t id) const noexcept {
    return std::span<const TokenId>(tokens_).subspan(id * page_size_, page_size_);
  }
  [[nodiscard]] std::span<PageId> pages_of(std::uint32_t id) noexcept {
    return std::span<PageId>(pages_).subspan(id * streams_, streams_);
  }

  static std::uint64_t child_key(std::uint32_t parent, std::uint64_t block_hash) noexcept {
    return Fingerprint(block_hash).add_word(parent).value();
  }

  [[nodiscard]] std::uint32_t find_child(std::uint32_t parent,
                                         std::span<const TokenId> tokens) const {
    const std::uint64_t key = child_key(parent, block_hash_(tokens));
    return children_.find(key, [&](std::uint32_t id) {
      const Node& n = nodes_[id];
      if (n.child_key != key || n.parent != parent) return false;
      const auto cached = tokens_of(id);
      return std::equal(cached.begin(), cached.end(),
                        tokens.begin());  // never trust the hash alone
    });
  }

  // Fills path_ with the nodes of the longest cached whole-page prefix; returns its length.
  std::size_t find_path(const PrefixKey& key, std::span<const TokenId> tokens) const {
    path_.clear();
    const auto ns = namespaces_.find(key);
    if (ns == namespaces_.end()) return 0;
    const std::size_t count = tokens.size() / page_size_;
    path_.reserve(count);
    std::uint32_t node = ns->second;
    for (std::size_t p = 0; p < count; ++p) {
      node = find_child(node, block(tokens, p));
      if (node == kNone) break;
      path_.push_back(node);
    }
    return path_.size();
  }

  // Capacity for `fresh` more nodes in every array, so new_node(), the child table's insert and
  // the heap's push cannot throw, nor later free_nodes_.push_back.
  void reserve_nodes(std::size_t fresh) {
    const std::size_t reused = std::min(fresh, free_nodes_.size());
    const std::size_t total = nodes_.size() + (fresh - reused);
    KVPACK_CHECK(
        total < kNone, kOutOfRange,
        detail::message("PrefixIndex holds at most ", kNone - 1, " pages, ", total, " needed"));
    if (total > nodes_.capacity()) nodes_.reserve(std::max(total, 2 * nodes_.capacity()));
    // Each array follows nodes_' capacity on its own (no-ops when it already does), so a throw
    // between them leaves nothing behind that a later call would miss.
    const std::size_t capacity = nodes_.capacity();
    tokens_.reserve(capacity * page_size_);
    pages_.reserve(capacity * streams_);
    free_nodes_.reserve(capacity);
    heap_.reserve(capacity);
    children_.reserve(children_.size() + fresh,
                      [&](std::uint32_t id) { return nodes_[id].child_key; });
  }

  std::uint32_t new_node() noexcept {
    std::uint32_t id;
    if (!free_nodes_.empty()) {
      id = free_nodes_.back();
      free_nodes_.pop_back();
    } else {
      id = static_cast<std::uint32_t>(nodes_.size());
      nodes_.emplace_back();
      tokens_.resize(tokens_.size() + page_size_);
      pages_.resize(pages_.size() + streams_);
    }
    nodes_[id] = Node{};
    nodes_[id].alive = true;
    ++cached_nodes_;
    return id;
  }

  void free_node(std::uint32_t id) noexcept {
    nodes_[id].alive = false;
    free_nodes_.push_back(id);  // capacity reserved with nodes_
    --cached_nodes_;
  }

  [[nodiscard]] LruLess lru_less() const noexcept { return LruLess{&nodes_}; }

  void pin(std::uint32_t id) noexcept {
    if (heap_.contains(id)) heap_.erase(id, lru_less());
    ++nodes_[id].pins;
  }

  void unpin(std::uint32_t id) noexcept {
    Node& n = nodes_[id];
    if (--n.pins == 0 && n.children == 0) heap_.push(id, lru_less());
  }

  void drop_leaf(std::uint32_t id, PrefixEviction& done) noexcept {
    for (PageId page : pages_of(id)) {
      if (pool_.ref_count(page) == 1) ++done.pool_pages_freed;
      pool_.release(page);
    }
    done.pool_refs += streams_;
    ++done.token_pages;
    const std::uint32_t parent = nodes_[id].parent;
    children_.erase(id, nodes_[id].child_key,
                    [&](std::uint32_t other) { return nodes_[other].child_key; });
    free_node(id);
    Node& p = nodes_[parent];
    --p.children;
    if (p.root_key != nullptr) {
      if (p.children == 0) {  // an empty namespace goes too
        namespaces_.erase(namespaces_.find(*p.root_key));
        free_node(parent);
      }
    } else if (p.children == 0 && p.pins == 0) {
      heap_.push(parent, lru_less());
    }
  }

  PageReferences pool_;
  std::size_t page_size_;
  std::size_t streams_;
  PrefixIndexOptions::BlockHash block_hash_;

  mutable std::mutex mutex_;
  std::unordered_map<PrefixKey, std::uint32_t, PrefixKeyHash> namespaces_;  // key -> root node
  std::vector<Node> nodes_;      // by node id; roots included
  std::vector<TokenId> tokens_;  // [node][page_size]
  std::vector<PageId> pages_;    // [node][streams]
  std::vector<std::uint32_t> free_nodes_;
  detail::NodeHashTable children_;           // every non-root node, by (parent, tokens)
  detail::IndexedMinHeap heap_;              // unpinned leaves in LRU order
  mutable std::vector<std::uint32_t> path_;  // scratch of find_path, under mutex_
  std::size_t cached_nodes_ = 0;             // alive nodes, roots included
  std::uint64_t clock_ = 0;
  PrefixIndexStats stats_;
};

inline void PrefixLease::reset() noexcept {
  if (index_ == nullptr) return;
  {
    std::lock_guard lock(index_->mutex_);
    index_->unpin(node_);
  }
  index_ = nullptr;
  pages_ = 0;
}

inline PrefixLease PrefixLease::share() const {
  if (index_ == nullptr) return {};
  std::lock_guard lock(index_->mutex_);
  index_->pin(node_);
  return PrefixLease(index_, node_, pages_);
}

}  // namespace kvpack::inline v0::paging
