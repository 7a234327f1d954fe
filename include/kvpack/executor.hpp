#pragma once
/// \file executor.hpp
/// \brief kvpack::ThreadPool: a small fixed-size pool that satisfies kvpack::Executor.

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "kvpack/core/types.hpp"

namespace kvpack::inline v0 {

/// `threads` workers including the caller: `pool(count, task)` runs task(0..count-1) on the
/// caller and threads - 1 helpers and returns when all are done. One parallel-for at a time;
/// concurrent callers are serialised. The first exception a task throws is rethrown.
class ThreadPool {
 public:
  explicit ThreadPool(std::size_t threads) {
    KVPACK_CHECK(threads >= 1, kInvalidArgument, "ThreadPool needs at least one thread");
    for (std::size_t i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& worker : workers_) worker.join();
  }

  [[nodiscard]] std::size_t size() const noexcept { return workers_.size() + 1; }

  void operator()(index_t count, const std::function<void(index_t)>& task) {
    if (count <= 0) return;
    std::lock_guard serial(caller_mutex_);
    {
      std::lock_guard lock(mutex_);
      task_ = &task;
      count_ = count;
      next_.store(0);
      pending_ = count;
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    run_tasks();
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void run_tasks() {
    for (index_t i = next_.fetch_add(1); i < count_.load(); i = next_.fetch_add(1)) {
      try {
        (*task_.load())(i);
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      std::lock_guard lock(mutex_);
      if (--pending_ == 0) done_.notify_all();
    }
  }

  void work() {
    std::size_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || (generation_ != seen && task_ != nullptr); });
        if (stopping_) return;
        seen = generation_;
      }
      run_tasks();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex caller_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  // Read by workers outside the lock, so atomic; written only under mutex_.
  std::atomic<const std::function<void(index_t)>*> task_{nullptr};
  std::atomic<index_t> count_{0};
  std::atomic<index_t> next_{0};
  index_t pending_ = 0;
  std::size_t generation_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
};

}  // namespace kvpack::inline v0
