#pragma once
/// \file device_memory.cuh
/// \brief Device memory owned by RAII handles: typed buffers, and the device page pool (one
///        cudaMalloc arena of fixed-size pages holding the same payload bytes as the host pool).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "kvpack/core/types.hpp"
#include "kvpack/kernels/cuda/check.cuh"
#include "kvpack/kernels/cuda/page_ledger.hpp"
#include "kvpack/paging/page_pool.hpp"

namespace kvpack::inline v0::kernels::cuda {

/// `count` elements of T in device memory (plain cudaMalloc: no managed memory).
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t count) : count_(count) {
    if (count > 0) check(cudaMalloc(reinterpret_cast<void**>(&data_), count * sizeof(T)), "cudaMalloc");
  }
  /// A device copy of `host`.
  explicit DeviceBuffer(std::span<const T> host) : DeviceBuffer(host.size()) { upload(host); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }

  [[nodiscard]] T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }

  void upload(std::span<const T> host) {
    KVPACK_CHECK(host.size() <= count_, kInvalidArgument,
                 ::kvpack::detail::message("DeviceBuffer::upload: ", host.size(), " elements into a buffer of ", count_));
    if (!host.empty()) check(cudaMemcpy(data_, host.data(), host.size_bytes(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_ > 0) check(cudaMemcpy(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    return host;
  }

 private:
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

/// A device array whose contents change between launches while its allocation stays: `assign`
/// copies host values in on a CUDA stream, after the launches queued there before it (which read
/// the old values), and allocates only when they outgrow it, doubling. So a layer that gains a
/// page neither allocates nor frees (cudaFree waits for the whole device). A copy from pageable
/// host memory is staged before `assign` returns (CUDA may wait for the stream to do so), so the
/// host values may then go.
template <class T>
class DeviceTable {
 public:
  void assign(std::span<const T> host, cudaStream_t stream) {
    if (host.size() > buffer_.size()) {
      check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");  // launches still reading the old array
      buffer_ = DeviceBuffer<T>(std::max(host.size(), 2 * buffer_.size()));
    }
    if (!host.empty()) {
      check(cudaMemcpyAsync(buffer_.data(), host.data(), host.size_bytes(), cudaMemcpyHostToDevice, stream),
            "table upload");
    }
    size_ = host.size();
  }

  [[nodiscard]] T* data() const noexcept { return buffer_.data(); }
  /// Elements assigned last; the allocation may hold more.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t allocated_bytes() const noexcept { return buffer_.size() * sizeof(T); }

 private:
  DeviceBuffer<T> buffer_;
  std::size_t size_ = 0;
};

/// Pages in device memory: one arena of `capacity` payloads of `format.payload_bytes` bytes,
/// allocated up front (a device pool does not grow: growing would move every page the block
/// tables point at). Page payloads are byte-identical to the host pool's, so a page moves
/// between the two with one copy and the kernels of either backend read it. A page may have
/// several holders (forks share pages; PageLedger counts them). Slot metadata (positions, live
/// masks) stays on the host. Thread-safe.
class DevicePagePool {
 public:
  DevicePagePool(paging::PageFormat format, std::size_t capacity) : format_(format), ledger_(capacity) {
    KVPACK_CHECK(format.payload_bytes > 0 && format.payload_bytes % 64 == 0, kInvalidConfig,
                 ::kvpack::detail::message("DevicePagePool: payload size must be a positive multiple of 64, got ",
                                           format.payload_bytes));
    KVPACK_CHECK(capacity <= std::numeric_limits<std::size_t>::max() / format.payload_bytes, kInvalidConfig,
                 ::kvpack::detail::message("DevicePagePool: ", capacity, " pages of ", format.payload_bytes,
                                           " bytes overflow the address space"));
    arena_ = DeviceBuffer<unsigned char>(format.payload_bytes * capacity);
  }

  [[nodiscard]] const paging::PageFormat& format() const noexcept { return format_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return ledger_.capacity(); }
  [[nodiscard]] std::size_t pages_in_use() const { return ledger_.pages_in_use(); }
  [[nodiscard]] std::size_t pages_available() const { return capacity() - pages_in_use(); }

  /// A free page with one holder; throws kvpack::OutOfPages when none is left.
  [[nodiscard]] PageId allocate() { return ledger_.allocate(); }
  /// One more holder of page `id` (a fork sharing it, a cached prefix). Sharing a page nobody
  /// holds, a bug, ends the program with the ledger's message, as release does.
  void retain(PageId id) noexcept { ledger_.retain(id); }
  /// One holder fewer; the page is free again after its last. Called from destructors and
  /// clean-ups: releasing a page nobody holds, a bug, ends the program with the ledger's message.
  void release(PageId id) noexcept { ledger_.release(id); }
  /// Holders of page `id` (PagePool's name for it, which PrefixIndex reads): 0 while it is free.
  [[nodiscard]] std::uint32_t ref_count(PageId id) const noexcept { return ledger_.holders(id); }

  /// Device address of a page's payload (64-byte aligned: cudaMalloc aligns the arena to 256).
  [[nodiscard]] std::byte* payload(PageId id) const noexcept {
    return reinterpret_cast<std::byte*>(arena_.data()) + static_cast<std::size_t>(id) * format_.payload_bytes;
  }

  /// Copies one payload from host memory (a host pool's page) into device page `id`.
  void upload(PageId id, const std::byte* host_payload) {
    check(cudaMemcpy(payload(id), host_payload, format_.payload_bytes, cudaMemcpyHostToDevice), "page upload");
  }
  /// Copies device page `id` into host memory.
  void download(PageId id, std::byte* host_payload) const {
    check(cudaMemcpy(host_payload, payload(id), format_.payload_bytes, cudaMemcpyDeviceToHost), "page download");
  }

 private:
  paging::PageFormat format_;
  PageLedger ledger_;  // checks the capacity before the arena is allocated
  DeviceBuffer<unsigned char> arena_;
};

}  // namespace kvpack::inline v0::kernels::cuda
