#pragma once
/// \file device_params.cuh
/// \brief Codec parameters made readable by the device: most codecs' parameters are plain values
///        and cross unchanged; KVQuant's and TurboQuant's point into host tables, whose parts the
///        kernels read (KVQuant's per-channel key ranges, TurboQuant's rotation as a d×d matrix)
///        are copied to device memory here (element_decode.hpp defines the device forms).

#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvpack/kernels/cuda/device_memory.cuh"
#include "kvpack/kernels/cuda/element_decode.hpp"

namespace kvpack::inline v0::kernels::cuda {

/// Owns the device copies behind the device parameters it makes; keep it as long as they are read.
/// TurboQuant's rotation matrices and signs are sent once per distinct contents (a layer's
/// streams share one rotation).
/// A copy shares the device copies (a forked layer reads its parent's parameters); each lives
/// until its last holder goes.
class DeviceParamTables {
 public:
  template <class Codec>
  device_params_t<Codec> upload(const typename Codec::params_type& host, quant::PageGeometry g) {
    using Device = device_params_t<Codec>;
    if constexpr (std::is_same_v<Device, KVQuantDeviceKeyParams>) {
      // One buffer per stream, offsets then half-ranges: a few KiB, copied whatever host tables
      // they came from, so a layer never depends on host memory staying alive.
      std::vector<float> both(host.offset, host.offset + g.head_dim);
      both.insert(both.end(), host.half_range, host.half_range + g.head_dim);
      tables_.reserve(tables_.size() + 1);
      tables_.push_back(std::make_shared<DeviceBuffer<float>>(std::span<const float>(both)));
      const float* device = tables_.back()->data();
      return to_device_params(host, g, device, device + g.head_dim);
    } else if constexpr (std::is_same_v<Device, KVQuantDeviceValueParams>) {
      return to_device_params(host, g);
    } else if constexpr (std::is_same_v<Device, TurboDeviceParams>) {
      // Checks the tables exist before anything is allocated.
      TurboDeviceParams params = to_device_params(host, g, nullptr);
      const quant::RotationView& rotation = quant::turbo_detail::layer_view(host, g.head_dim).rotation;
      params.transform = upload_once(turbo_transform(rotation, g.head_dim, Codec::kPlane));
      params.rotation = upload_once(turbo_rotation_table(rotation));
      return params;
    } else {
      static_assert(std::is_same_v<Device, typename Codec::params_type>);
      return host;
    }
  }

  /// A device copy of `host`, sent once per distinct contents: a layer's streams share one
  /// rotation, so TurboQuant's matrices and signs are recognised by what they hold.
  const float* upload_once(std::vector<float> host) {
    for (const Uploaded& earlier : shared_) {
      if (*earlier.host == host) return tables_[earlier.table]->data();
    }
    tables_.reserve(tables_.size() + 1);
    shared_.reserve(shared_.size() + 1);
    auto kept = std::make_shared<const std::vector<float>>(std::move(host));
    tables_.push_back(std::make_shared<DeviceBuffer<float>>(std::span<const float>(*kept)));
    shared_.push_back({std::move(kept), tables_.size() - 1});
    return tables_.back()->data();
  }

  /// Device bytes of the tables it holds (a table shared with a copy counts in both).
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t total = 0;
    for (const auto& table : tables_) total += table->size() * sizeof(float);
    return total;
  }

  /// How many device tables it holds; with discard_from, lets a caller undo a failed step.
  [[nodiscard]] std::size_t table_count() const noexcept { return tables_.size(); }
  /// Frees every table uploaded after the first `count` (nothing may still read them).
  void discard_from(std::size_t count) noexcept {
    if (count < tables_.size()) tables_.erase(tables_.begin() + static_cast<std::ptrdiff_t>(count), tables_.end());
    std::erase_if(shared_, [count](const Uploaded& m) { return m.table >= count; });
  }

 private:
  /// A table sent by upload_once, with the host copy it is recognised by (shared by copies too).
  struct Uploaded {
    std::shared_ptr<const std::vector<float>> host;
    std::size_t table;
  };
  std::vector<std::shared_ptr<const DeviceBuffer<float>>> tables_;
  std::vector<Uploaded> shared_;
};

}  // namespace kvpack::inline v0::kernels::cuda
