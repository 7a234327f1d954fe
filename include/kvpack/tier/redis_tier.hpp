#pragma once
/// \file redis_tier.hpp
/// \brief RedisTier: entries in a Redis or Valkey server through hiredis, so pages written by one
///        process are found by another, on this machine or across a network. Needs hiredis
///        (Debian libhiredis-dev) at build and link time: link the `kvpack::redis` CMake target.
///        Not included by kvpack/tier.hpp for that reason.
///
/// Each entry is one string value, sealed (sealed_entry.hpp). A failure to connect, a timeout or
/// a dropped connection throws kUnavailable naming the server and the cause; the connection is
/// then dropped and the next call connects again, so a restarted server is picked up without
/// rebuilding the tier. Thread-safe: calls are serialized (a hiredis context is not shared).
/// hiredis writes with write(2), which raises SIGPIPE on a connection the server reset (a put
/// after a restart): each command blocks SIGPIPE in its thread and discards one it raised, so a
/// dead connection is an error, not the end of the process.

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>
#include <time.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/tier/sealed_entry.hpp"
#include "kvpack/tier/tier.hpp"

namespace kvpack::inline v0::tier {

struct RedisTierOptions {
  std::string host = "127.0.0.1";
  int port = 6379;
  /// Bounds connecting and every command, so a dead server fails a call instead of hanging it.
  int timeout_ms = 2000;
  /// Prepended to every key: one server can hold several caches' entries apart.
  std::string key_prefix = "kvpack:";
  /// When > 0, entries expire this many seconds after their put (Redis `SET … EX`).
  int expire_seconds = 0;
};

class RedisTier final : public Tier {
 public:
  /// Largest payload: Redis strings hold at most 512 MiB, the frame included.
  static constexpr std::size_t kMaxEntryBytes = (std::size_t{512} << 20) - kSealBytes;

  /// Does not connect: the first call does (and reports a server that is down).
  explicit RedisTier(RedisTierOptions options = {}) : options_(std::move(options)) {
    KVPACK_CHECK(options_.port > 0 && options_.port < 65536, kInvalidArgument,
                 detail::message("RedisTier: port ", options_.port, " is not a TCP port"));
    KVPACK_CHECK(options_.timeout_ms > 0, kInvalidArgument, "RedisTier: timeout_ms must be > 0");
    KVPACK_CHECK(options_.expire_seconds >= 0, kInvalidArgument, "RedisTier: expire_seconds must be >= 0");
  }

  [[nodiscard]] std::string describe() const override {
    return detail::message("redis ", options_.host, ":", options_.port);
  }

  void put(std::string_view key, std::span<const std::byte> bytes) override {
    check_tier_key(key, "RedisTier::put");
    KVPACK_CHECK(bytes.size() <= kMaxEntryBytes, kOutOfRange,
                 detail::message("RedisTier::put: an entry of ", bytes.size(), " bytes exceeds Redis's ",
                                 kMaxEntryBytes, "-byte limit"));
    const std::vector<std::byte> sealed = seal(key, bytes);
    const std::string name = options_.key_prefix + std::string(key);
    std::lock_guard lock(mutex_);
    const Reply reply = options_.expire_seconds > 0
                            ? command("SET %b %b EX %d", name.data(), name.size(), sealed.data(), sealed.size(),
                                      options_.expire_seconds)
                            : command("SET %b %b", name.data(), name.size(), sealed.data(), sealed.size());
    expect(reply, REDIS_REPLY_STATUS, "SET");
    ++stats_.puts;
    stats_.bytes_written += bytes.size();
  }

  [[nodiscard]] std::optional<std::vector<std::byte>> get(std::string_view key) override {
    check_tier_key(key, "RedisTier::get");
    const std::string name = options_.key_prefix + std::string(key);
    std::lock_guard lock(mutex_);
    const Reply reply = command("GET %b", name.data(), name.size());
    ++stats_.gets;
    if (reply->type == REDIS_REPLY_NIL) return std::nullopt;
    expect(reply, REDIS_REPLY_STRING, "GET");
    const std::span<const std::byte> sealed(reinterpret_cast<const std::byte*>(reply->str), reply->len);
    const std::span<const std::byte> payload = unseal(key, sealed, describe() + " entry '" + name + "'");
    ++stats_.hits;
    stats_.bytes_read += payload.size();
    return std::vector<std::byte>(payload.begin(), payload.end());
  }

  bool erase(std::string_view key) override {
    check_tier_key(key, "RedisTier::erase");
    const std::string name = options_.key_prefix + std::string(key);
    std::lock_guard lock(mutex_);
    const Reply reply = command("DEL %b", name.data(), name.size());
    expect(reply, REDIS_REPLY_INTEGER, "DEL");
    return reply->integer > 0;
  }

  [[nodiscard]] TierStats stats() const override {
    std::lock_guard lock(mutex_);
    return stats_;
  }

 private:
  struct FreeReply {
    void operator()(redisReply* reply) const noexcept { freeReplyObject(reply); }
  };
  struct FreeContext {
    void operator()(redisContext* context) const noexcept { redisFree(context); }
  };
  using Reply = std::unique_ptr<redisReply, FreeReply>;

  [[noreturn]] void unavailable(std::string_view what) {
    context_.reset();  // a broken context is never reused; the next call reconnects
    detail::throw_error(ErrorCode::kUnavailable, detail::message(describe(), ": ", what));
  }

  void connect() {
    const timeval timeout{options_.timeout_ms / 1000, (options_.timeout_ms % 1000) * 1000};
    context_.reset(redisConnectWithTimeout(options_.host.c_str(), options_.port, timeout));
    if (!context_) unavailable("cannot allocate a connection");
    if (context_->err != 0) unavailable(detail::message("cannot connect: ", context_->errstr));
    if (redisSetTimeout(context_.get(), timeout) != REDIS_OK) unavailable("cannot set the command timeout");
  }

  /// Blocks SIGPIPE in this thread for its lifetime; a SIGPIPE raised meanwhile (and not
  /// pending before) is consumed, then the old mask comes back.
  class SigpipeBlocked {
   public:
    SigpipeBlocked() {
      sigemptyset(&pipe_);
      sigaddset(&pipe_, SIGPIPE);
      sigset_t pending;
      sigpending(&pending);
      was_pending_ = sigismember(&pending, SIGPIPE) == 1;
      pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    }
    ~SigpipeBlocked() {
      sigset_t pending;
      sigpending(&pending);
      if (!was_pending_ && sigismember(&pending, SIGPIPE) == 1) {
        const timespec now{0, 0};
        sigtimedwait(&pipe_, nullptr, &now);
      }
      pthread_sigmask(SIG_SETMASK, &old_, nullptr);
    }
    SigpipeBlocked(const SigpipeBlocked&) = delete;
    SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;

   private:
    sigset_t pipe_{};
    sigset_t old_{};
    bool was_pending_ = false;
  };

  template <class... Args>
  Reply command(const char* format, Args... args) {
    if (!context_) connect();
    const SigpipeBlocked blocked;
    Reply reply(static_cast<redisReply*>(redisCommand(context_.get(), format, args...)));
    if (!reply) unavailable(detail::message("the connection failed: ", context_->errstr));
    return reply;
  }

  void expect(const Reply& reply, int type, std::string_view verb) {
    if (reply->type == type) return;
    const std::string said = reply->type == REDIS_REPLY_ERROR ? std::string(reply->str, reply->len) : "";
    detail::throw_error(ErrorCode::kUnavailable, detail::message(describe(), ": ", verb, " was refused (reply type ",
                                                                 reply->type, said.empty() ? "" : ": ", said, ")"));
  }

  RedisTierOptions options_;
  mutable std::mutex mutex_;
  std::unique_ptr<redisContext, FreeContext> context_;
  TierStats stats_;
};

}  // namespace kvpack::inline v0::tier
