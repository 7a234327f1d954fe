// The CUDA append path's unit encoders (kernels/cuda/element_encode.hpp), compiled for the host:
// encoding every unit of a plane must give exactly the bytes of the codec's scalar `encode`, and
// must write every byte of the plane (the target starts as garbage). Random rows with outlier
// channels, zero rows, ties for ggml's rounding and the largest storable magnitudes.

#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "kvpack/kernels/cuda/element_encode.hpp"
#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;

std::vector<float> rows_for(index_t page_size, index_t head_dim, float max_abs, std::uint32_t seed) {
  std::vector<float> rows = test::random_rows(static_cast<std::size_t>(page_size), head_dim, seed, 3, 40.0f);
  std::fill_n(rows.begin() + head_dim, head_dim, 0.0f);  // a zero row
  const float big = std::min(max_abs, 1e30f);
  for (index_t c = 0; c < head_dim; ++c) rows[2 * head_dim + c] = c % 3 == 0 ? big : -big / 2;
  for (index_t c = 0; c < head_dim; ++c) rows[3 * head_dim + c] = 0.5f * static_cast<float>(c % 7) - 1.5f;  // ties
  return rows;
}

template <class Codec>
void check_codec(const Codec& codec, typename Codec::params_type params, quant::PageGeometry g) {
  using Encoder = kernels::cuda::ElementEncoder<Codec>;
  try {
    codec.validate(g);
  } catch (const Error&) {
    return;  // a geometry this codec cannot store
  }
  const std::vector<float> rows = rows_for(g.page_size, g.head_dim, codec.max_abs_input(), 23);
  const std::size_t bytes = codec.plane_bytes(g);
  std::vector<std::byte> expected(bytes, std::byte{0}), got(bytes, std::byte{0xAB});
  codec.encode(g, rows.data(), g.head_dim, params, expected.data());
  for (index_t u = 0; u < Encoder::units(g); ++u) Encoder::encode_unit(rows.data(), g.head_dim, params, got.data(), g, u);
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < bytes; ++i) mismatches += expected[i] != got[i];
  INFO(Codec::kName << " page_size " << g.page_size << " head_dim " << g.head_dim << ": " << mismatches << " of "
                    << bytes << " bytes differ");
  CHECK(mismatches == 0);
}

template <class Quantizer>
void check_quantizer(std::vector<quant::PageGeometry> geometries) {
  const Quantizer q{};
  for (const quant::PageGeometry g : geometries) {
    check_codec(q.key, q.key.initial_params(0, 0), g);
    check_codec(q.value, q.value.initial_params(0, 0), g);
  }
}

}  // namespace

TEST_CASE("CUDA unit encoders write exactly the scalar encoders' bytes", "[cuda][encode]") {
  const std::vector<quant::PageGeometry> shapes{{32, 128}, {16, 64}, {64, 96}, {256, 32}};
  check_quantizer<quant::Float<float>>(shapes);
  check_quantizer<quant::Float<half>>(shapes);
  check_quantizer<quant::Float<bfloat16>>(shapes);
  check_quantizer<quant::Int8>(shapes);
  check_quantizer<quant::Q8_0>(shapes);
  check_quantizer<quant::Q4_0>(shapes);
  check_quantizer<quant::KIVI<2, 32>>(shapes);
  check_quantizer<quant::KIVI<4, 32>>(shapes);
  check_quantizer<quant::KIVI<4, 128>>({{128, 128}, {256, 256}});
  for (const float scale : {1.0f, 0.37f, 1e-3f}) {
    check_codec(quant::FP8Codec<quant::E4M3FN, Plane::kKey>{}, {scale}, {32, 128});
    check_codec(quant::FP8Codec<quant::E4M3FN, Plane::kValue>{}, {scale}, {32, 128});
    check_codec(quant::FP8Codec<quant::E5M2, Plane::kKey>{}, {scale}, {16, 48});
    check_codec(quant::FP8Codec<quant::E5M2, Plane::kValue>{}, {scale}, {16, 48});
  }
  check_codec(quant::KiviTokenCodec<2, 32, Plane::kKey>{}, {}, {32, 128});
}

static_assert(!kernels::cuda::DeviceEncodable<quant::KVQuantValueCodec<4>>,
              "KVQuant is not on the device yet: the append path must reject it at compile time");
