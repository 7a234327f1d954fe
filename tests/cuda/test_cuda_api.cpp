// The CUDA backend through its CUDA-free API (kvpack/backend/cuda_api.hpp), from a file compiled
// by the host C++ compiler and linked with kvpack::cuda, as an engine without nvcc would use it.
// "[host]" runs everywhere: the library links, answers without a device, and dispatch keeps host
// buffers on the CPU. "[device]" needs a GPU (without one the binary exits 77, CTest's skip):
// kernels::attend_paged sends a launch over device memory to the CUDA kernels, which match the
// scalar reference; mixed host and device buffers are rejected; pages encoded through the API
// equal the host encoder's bytes.

#define CATCH_CONFIG_RUNNER
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "kvpack/backend/cuda_api.hpp"
#include "kvpack/kernels/attend_paged.hpp"
#include "kvpack/kvpack.hpp"
#include "support/host_launch.hpp"

static_assert(KVPACK_HAS_CUDA == 1, "linking kvpack::cuda defines KVPACK_HAS_CUDA=1");

namespace {

using namespace kvpack;
using test::HostLaunch;
using test::StreamLength;

void cuda_check(cudaError_t status, const char* what) {
  INFO(what << ": " << cudaGetErrorString(status));
  REQUIRE(status == cudaSuccess);
}

/// A device copy of a host buffer, freed with the object.
template <class T>
struct DeviceCopy {
  T* data = nullptr;
  explicit DeviceCopy(std::span<const T> host) {
    cuda_check(cudaMalloc(reinterpret_cast<void**>(&data), std::max<std::size_t>(1, host.size_bytes())), "cudaMalloc");
    if (!host.empty()) cuda_check(cudaMemcpy(data, host.data(), host.size_bytes(), cudaMemcpyHostToDevice), "upload");
  }
  ~DeviceCopy() { cudaFree(data); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  [[nodiscard]] std::vector<T> download(std::size_t count) const {
    std::vector<T> host(count);
    cuda_check(cudaMemcpy(host.data(), data, count * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }
};

/// A host launch's arrays copied to the device, pages included; `args` points at the copies.
template <class Quantizer>
struct DeviceLaunch {
  using KeyCodec = typename Quantizer::key_codec;
  using ValueCodec = typename Quantizer::value_codec;
  const HostLaunch<Quantizer>& host;
  std::vector<std::byte> page_bytes;
  DeviceCopy<std::byte> payloads;
  std::vector<const std::byte*> page_addresses;
  DeviceCopy<const std::byte*> pages;
  DeviceCopy<index_t> first_page, tail_count;
  DeviceCopy<typename KeyCodec::params_type> key_params;
  DeviceCopy<typename ValueCodec::params_type> value_params;
  DeviceCopy<float> tail_keys, tail_values, queries, out;

  explicit DeviceLaunch(const HostLaunch<Quantizer>& h)
      : host(h),
        page_bytes(gather_pages(h)),
        payloads(std::span<const std::byte>(page_bytes)),
        page_addresses(addresses(h, payloads.data)),
        pages(std::span<const std::byte* const>(page_addresses)),
        first_page(std::span<const index_t>(h.first_page)),
        tail_count(std::span<const index_t>(h.tail_count)),
        key_params(std::span<const typename KeyCodec::params_type>(h.key_params)),
        value_params(std::span<const typename ValueCodec::params_type>(h.value_params)),
        tail_keys(std::span<const float>(h.tail_keys)),
        tail_values(std::span<const float>(h.tail_values)),
        queries(std::span<const float>(h.queries)),
        out(std::span<const float>(h.out)) {}

  static std::vector<std::byte> gather_pages(const HostLaunch<Quantizer>& h) {
    const std::size_t bytes = h.fixtures.front()->payload_bytes;
    std::vector<std::byte> all(h.pages.size() * bytes);
    for (std::size_t i = 0; i < h.pages.size(); ++i) std::memcpy(all.data() + i * bytes, h.pages[i], bytes);
    return all;
  }
  static std::vector<const std::byte*> addresses(const HostLaunch<Quantizer>& h, const std::byte* base) {
    std::vector<const std::byte*> at;
    for (std::size_t i = 0; i < h.pages.size(); ++i) at.push_back(base + i * h.fixtures.front()->payload_bytes);
    return at;
  }

  [[nodiscard]] kernels::PagedArgs<KeyCodec, ValueCodec> args(HostLaunch<Quantizer>& h) const {
    kernels::PagedArgs<KeyCodec, ValueCodec> a = h.args();
    a.pages = pages.data;
    a.first_page = first_page.data;
    a.key_params = key_params.data;
    a.value_params = value_params.data;
    a.tail_keys = h.tail_stride > 0 ? tail_keys.data : nullptr;
    a.tail_values = h.tail_stride > 0 ? tail_values.data : nullptr;
    a.tail_count = h.tail_stride > 0 ? tail_count.data : nullptr;
    a.queries = queries.data;
    a.out = out.data;
    return a;
  }
};

template <class Quantizer>
void check_device_launch(index_t page_size, index_t head_dim, index_t group, const std::vector<StreamLength>& lengths,
                         std::uint32_t seed) {
  HostLaunch<Quantizer> host(page_size, head_dim, group, lengths, seed);
  const DeviceLaunch<Quantizer> device(host);
  kernels::PagedWorkspace workspace;
  kernels::attend_paged<typename Quantizer::key_codec, typename Quantizer::value_codec>(device.args(host),
                                                                                        host.max_pages, workspace);
  cuda_check(cudaDeviceSynchronize(), "attend_paged");
  host.check_outputs(device.out.download(host.out.size()), test::kCudaKernels);
}

}  // namespace

TEST_CASE("kvpack::cuda links into host-compiled code and answers without a device", "[host]") {
  STATIC_REQUIRE(dispatch::kHasCudaBackend);
  // What the library precompiles, and so what the entry points accept at compile time.
  STATIC_REQUIRE(cuda_api::CudaAttended<quant::Q4_0::key_codec, quant::Q4_0::value_codec>);
  STATIC_REQUIRE(cuda_api::CudaAttended<quant::KVQuant<3>::key_codec, quant::KVQuant<3>::value_codec>);
  STATIC_REQUIRE_FALSE(cuda_api::CudaEncoded<quant::KVQuant<3>::key_codec, quant::KVQuant<3>::value_codec>);
  STATIC_REQUIRE_FALSE(cuda_api::CudaAttended<quant::KIVI<4, 64>::key_codec, quant::KIVI<4, 64>::value_codec>);
  STATIC_REQUIRE_FALSE(cuda_api::CudaAttended<quant::Q4_0::key_codec, quant::Q8_0::value_codec>);
  INFO(cuda_api::device_count() << " CUDA device(s)");  // never throws, whatever the machine has
  const std::vector<float> host_buffer(16, 1.0f);
  CHECK_FALSE(cuda_api::is_device_pointer(nullptr));
  CHECK_FALSE(cuda_api::is_device_pointer(host_buffer.data()));
  CHECK(dispatch::backend_of(host_buffer.data()) == dispatch::Backend::kCpu);
  cuda_api::AttentionWorkspace workspace;  // touches no device
  cuda_api::AttentionWorkspace moved = std::move(workspace);
  static_cast<void>(moved);
}

TEST_CASE("with kvpack::cuda linked, a launch over host memory still runs on the CPU", "[host]") {
  HostLaunch<quant::Q4_0> launch(32, 128, 4, {{5, 9}, {0, 3}}, 11);
  kernels::PagedWorkspace workspace;
  kernels::attend_paged<quant::Q4_0::key_codec, quant::Q4_0::value_codec>(launch.args(), launch.max_pages, workspace);
  launch.check_outputs(launch.out, dispatch::active_cpu_isa());
}

TEST_CASE("a launch over device memory runs on the CUDA backend and matches the reference", "[device]") {
  const std::vector<StreamLength> mixed{{9, 31}, {1, 0}, {0, 7}, {4, 13}};
  check_device_launch<quant::Float<half>>(32, 128, 4, mixed, 100);  // tensor cores
  check_device_launch<quant::Q4_0>(32, 128, 4, mixed, 200);         // tensor cores
  check_device_launch<quant::KIVI<4, 32>>(32, 128, 4, mixed, 300);  // generic kernel
  check_device_launch<quant::Int8>(16, 96, 3, {{5, 0}, {0, 16}}, 500);
  // No tail rows anywhere: tail_count is null, which the kernels read until 2026-12-08.
  check_device_launch<quant::Float<half>>(32, 128, 4, {{5, 0}, {3, 0}}, 600);
  check_device_launch<quant::KIVI<4, 32>>(32, 128, 4, {{5, 0}, {3, 0}}, 700);
}

TEST_CASE("a launch mixing host and device memory is rejected before it runs", "[device]") {
  HostLaunch<quant::Q4_0> host(32, 64, 2, {{3, 5}}, 21);
  const DeviceLaunch<quant::Q4_0> device(host);
  kernels::PagedArgs<quant::Q4_0::key_codec, quant::Q4_0::value_codec> a = device.args(host);
  a.queries = host.queries.data();
  kernels::PagedWorkspace workspace;
  try {
    kernels::attend_paged<quant::Q4_0::key_codec, quant::Q4_0::value_codec>(a, host.max_pages, workspace);
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(e.what(), Catch::Matchers::Contains("queries is in host memory"));
  }
}

TEST_CASE("pages encoded through the API equal the host encoder's bytes", "[device]") {
  using Q = quant::Q4_0;
  const index_t page_size = 32, head_dim = 128, pages = 3;
  const std::size_t rows = static_cast<std::size_t>(pages) * page_size;
  const std::vector<float> keys = test::random_rows(rows, head_dim, 31, 4, 10.0f);
  const std::vector<float> values = test::random_rows(rows, head_dim, 32);
  const test::StreamFixture<Q> host(page_size, head_dim, pages, 0, keys, values);
  const std::vector<std::byte> zeros(host.payload_bytes * pages);
  const DeviceCopy<std::byte> payloads{std::span<const std::byte>(zeros)};
  std::vector<std::byte*> addresses;
  for (index_t i = 0; i < pages; ++i) addresses.push_back(payloads.data + i * host.payload_bytes);
  const DeviceCopy<std::byte*> device_addresses{std::span<std::byte* const>(addresses)};
  const DeviceCopy<float> device_keys{std::span<const float>(keys)}, device_values{std::span<const float>(values)};
  cuda_api::encode_pages<Q::key_codec, Q::value_codec>(device_keys.data, device_values.data, head_dim, pages,
                                                       host.key_params, host.value_params, device_addresses.data,
                                                       host.geometry, host.value_offset);
  cuda_check(cudaDeviceSynchronize(), "encode_pages");
  const std::vector<std::byte> encoded = payloads.download(zeros.size());
  // The planes, not the padding between them (which the host fixture leaves uninitialised).
  const std::size_t key_bytes = host.quantizer.key.plane_bytes(host.geometry);
  const std::size_t value_bytes = host.quantizer.value.plane_bytes(host.geometry);
  for (index_t i = 0; i < pages; ++i) {
    INFO("page " << i);
    const std::byte* page = encoded.data() + i * host.payload_bytes;
    CHECK(std::memcmp(page, host.pages[i], key_bytes) == 0);
    CHECK(std::memcmp(page + host.value_offset, host.pages[i] + host.value_offset, value_bytes) == 0);
  }
}

int main(int argc, char** argv) {
  bool wants_device = false;
  for (int i = 1; i < argc; ++i) {
    wants_device = wants_device || std::string_view(argv[i]).find("[device]") != std::string_view::npos;
  }
  if (kvpack::cuda_api::device_count() == 0) {
    if (wants_device) {
      std::printf("kvpack_test_cuda_api [device]: skipped, no CUDA device is usable here\n");
      return 77;
    }
    if (argc == 1) {  // everything was asked for: what runs without a device
      std::printf("kvpack_test_cuda_api: no CUDA device is usable here, running the [host] cases only\n");
      char host_only[] = "[host]";
      char* host_argv[] = {argv[0], host_only, nullptr};
      return Catch::Session().run(2, host_argv);
    }
  }
  return Catch::Session().run(argc, argv);
}
