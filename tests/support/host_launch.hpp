#pragma once
// One kernels::attend_paged launch over host memory: streams built with the codecs' scalar
// encoders (stream_fixture.hpp) from random rows with outlier channels, a zero key row and huge
// elements, laid out as an engine's page tables; each stream's output checked against the scalar
// reference within support/error_bound.hpp's bound. Shared by the kernels module and the CUDA API
// test (which also copies a launch to the device).

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <memory>
#include <string_view>
#include <vector>

#include "kvpack/kernels/attend_paged.hpp"
#include "kvpack/kernels/reference.hpp"
#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"
#include "support/stream_fixture.hpp"

namespace kvpack::test {

struct StreamLength {
  index_t pages = 0;
  index_t tail = 0;
};

/// Streams built with the codecs' scalar encoders, laid out as one launch's arrays.
template <class Quantizer>
struct HostLaunch {
  using KeyCodec = typename Quantizer::key_codec;
  using ValueCodec = typename Quantizer::value_codec;

  index_t group, head_dim, tail_stride = 0, max_pages = 0;
  std::vector<std::unique_ptr<test::StreamFixture<Quantizer>>> fixtures;
  std::vector<std::vector<float>> stream_queries;
  std::vector<const std::byte*> pages;
  std::vector<index_t> first_page{0}, tail_count;
  std::vector<typename KeyCodec::params_type> key_params;
  std::vector<typename ValueCodec::params_type> value_params;
  std::vector<float> tail_keys, tail_values, queries, out;

  HostLaunch(index_t page_size, index_t head_dim_, index_t group_, const std::vector<StreamLength>& lengths,
             std::uint32_t seed)
      : group(group_), head_dim(head_dim_) {
    for (const StreamLength& s : lengths) {
      tail_stride = std::max(tail_stride, s.tail);
      max_pages = std::max(max_pages, s.pages);
    }
    for (std::size_t s = 0; s < lengths.size(); ++s) {
      const std::size_t rows = static_cast<std::size_t>(lengths[s].pages) * page_size + lengths[s].tail;
      const auto stream_seed = seed + 10 * static_cast<std::uint32_t>(s);
      // Outlier key channels (random_rows), and where the stream is long enough a zero key row,
      // one huge key element and one huge value element.
      std::vector<float> keys = test::random_rows(rows, head_dim, stream_seed, 4, 10.0f);
      std::vector<float> values = test::random_rows(rows, head_dim, stream_seed + 1);
      if (rows > 9) {
        std::fill_n(keys.begin() + 3 * head_dim, head_dim, 0.0f);
        keys[7 * head_dim + 1] = 900.0f;
        values[9 * head_dim + 2] = -400.0f;
      }
      std::vector<float> q = test::random_rows(static_cast<std::size_t>(group), head_dim, stream_seed + 2, 4, 3.0f);
      for (float& x : q) x /= std::sqrt(static_cast<float>(head_dim));
      fixtures.push_back(std::make_unique<test::StreamFixture<Quantizer>>(page_size, head_dim, lengths[s].pages,
                                                                          lengths[s].tail, keys, values));
      const auto& f = *fixtures.back();
      pages.insert(pages.end(), f.pages.begin(), f.pages.end());
      first_page.push_back(static_cast<index_t>(pages.size()));
      key_params.push_back(f.key_params);
      value_params.push_back(f.value_params);
      tail_count.push_back(lengths[s].tail);
      std::vector<float> padded_keys(static_cast<std::size_t>(tail_stride) * head_dim, 0.0f),
          padded_values = padded_keys;
      std::copy(f.tail_keys.begin(), f.tail_keys.end(), padded_keys.begin());
      std::copy(f.tail_values.begin(), f.tail_values.end(), padded_values.begin());
      tail_keys.insert(tail_keys.end(), padded_keys.begin(), padded_keys.end());
      tail_values.insert(tail_values.end(), padded_values.begin(), padded_values.end());
      queries.insert(queries.end(), q.begin(), q.end());
      stream_queries.push_back(std::move(q));
    }
    out.assign(queries.size(), -7.0f);
  }

  [[nodiscard]] kernels::PagedArgs<KeyCodec, ValueCodec> args() {
    const auto& f = *fixtures.front();
    kernels::PagedArgs<KeyCodec, ValueCodec> a;
    a.pages = pages.data();
    a.first_page = first_page.data();
    a.key_params = key_params.data();
    a.value_params = value_params.data();
    a.tail_keys = tail_stride > 0 ? tail_keys.data() : nullptr;
    a.tail_values = tail_stride > 0 ? tail_values.data() : nullptr;
    a.tail_count = tail_stride > 0 ? tail_count.data() : nullptr;
    a.tail_stride = tail_stride;
    a.queries = queries.data();
    a.out = out.data();
    a.streams = static_cast<index_t>(fixtures.size());
    a.group = group;
    a.page_size = f.geometry.page_size;
    a.head_dim = head_dim;
    a.value_offset = f.value_offset;
    a.payload_bytes = f.payload_bytes;
    return a;
  }

  /// Each stream of `actual` ([streams][group][head_dim]) within support/error_bound.hpp's bound
  /// of the scalar reference, for the operands of target `isa`'s kernels (test::kCudaKernels for
  /// the device's).
  void check_outputs(const std::vector<float>& actual, std::string_view isa) const {
    for (std::size_t s = 0; s < fixtures.size(); ++s) {
      const auto& f = *fixtures[s];
      std::vector<float> expected(static_cast<std::size_t>(group) * head_dim);
      kernels::reference::attend_stream(f.quantizer.key, f.quantizer.value, f.run(), f.key_params, f.value_params,
                                        f.tail(), stream_queries[s].data(), group, expected.data());
      const double bound = test::error_bound(f, stream_queries[s], group, isa, nullptr);
      double worst = 0.0;
      for (std::size_t i = 0; i < expected.size(); ++i) {
        const double error = std::fabs(static_cast<double>(actual[s * expected.size() + i]) - expected[i]);
        worst = std::isnan(error) ? std::numeric_limits<double>::infinity() : std::max(worst, error);
      }
      INFO(Quantizer::name() << " stream " << s << " (" << f.pages.size() << " pages + "
                             << f.tail_keys.size() / head_dim << " rows): error " << worst << ", bound " << bound);
      CHECK(worst <= bound);
    }
  }
};

}  // namespace kvpack::test
