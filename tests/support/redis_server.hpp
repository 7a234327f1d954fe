#pragma once
// A redis-server child process on 127.0.0.1, for the Redis tier's tests and bench: started on a
// free port with persistence off, stopped (SIGKILL, as a crash would) and restarted on the same
// port at will, killed when the object goes away.

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace kvpack::test {

class RedisServer {
 public:
  /// The redis-server to run: $KVPACK_REDIS_SERVER, else redis-server from PATH.
  static std::string binary() {
    const char* named = std::getenv("KVPACK_REDIS_SERVER");
    return named != nullptr ? named : "redis-server";
  }

  /// Starts a server on the first port from `first_port` on that it can bind.
  /// \throws std::runtime_error naming the binary when none starts (not installed?).
  explicit RedisServer(int first_port = 20000 + static_cast<int>(::getpid() % 20000)) {
    for (int port = first_port; port < first_port + 20; ++port) {
      port_ = port;
      if (start()) return;
    }
    throw std::runtime_error("cannot start '" + binary() +
                             "' on 127.0.0.1 (is it installed? cmake/install_deps.sh installs redis-server)");
  }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;
  ~RedisServer() { kill(); }

  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] bool running() const noexcept { return pid_ > 0; }

  /// Kills the server without warning (SIGKILL), as a crash or an OOM kill would.
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  /// Starts it again on the same port; true when it answers.
  bool start() {
    kill();
    const std::string port = std::to_string(port_);
    std::vector<std::string> args{binary(), "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                  "no", "--daemonize", "no", "--loglevel", "warning", "--logfile", ""};
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    // Neither output goes to the test's: a test that dies would otherwise leave the server
    // holding its pipes, and whoever reads them (ctest) waiting.
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
    pid_t pid = -1;
    const int spawned = posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (spawned != 0) return false;
    pid_ = pid;
    // Up to 5 s for it to answer; a server that exited (port taken) fails at once. The one
    // that answers must be ours: another test's server may hold the port.
    for (int attempt = 0; attempt < 100; ++attempt) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      if (const std::optional<long> answering = server_pid()) {
        if (*answering == pid_) return true;
        kill();
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    kill();
    return false;
  }

 private:
  /// The process id of the server answering on the port (INFO server), if one answers.
  [[nodiscard]] std::optional<long> server_pid() const {
    const timeval timeout{0, 200000};
    redisContext* context = redisConnectWithTimeout("127.0.0.1", port_, timeout);
    std::optional<long> pid;
    if (context != nullptr && context->err == 0) {
      if (auto* reply = static_cast<redisReply*>(redisCommand(context, "INFO server"))) {
        if (reply->type == REDIS_REPLY_STRING) {
          const std::string info(reply->str, reply->len);
          const std::size_t at = info.find("process_id:");
          if (at != std::string::npos) pid = std::strtol(info.c_str() + at + 11, nullptr, 10);
        }
        freeReplyObject(reply);
      }
    }
    if (context != nullptr) redisFree(context);
    return pid;
  }

  int port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace kvpack::test
