/// \file test_model_presets.cpp
/// \brief The model presets and the KV-size formula that kv_calculator prints.
///
/// Expected sizes are computed here in integer arithmetic from the models' published config
/// values, not from the preset table, so a wrong preset or a wrong formula both fail.

#include <catch2/catch.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "../../../examples/common/model_presets.hpp"
#include "kvpack/core/half.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"

namespace Catch {
/// Prints a mismatched shape as its four fields instead of Catch's "{?}".
template <>
struct StringMaker<kvpack::ModelShape> {
  static std::string convert(const kvpack::ModelShape& s) {
    return "{layers " + std::to_string(s.layers) + ", q_heads " + std::to_string(s.q_heads) +
           ", kv_heads " + std::to_string(s.kv_heads) + ", head_dim " + std::to_string(s.head_dim) +
           "}";
  }
};
}  // namespace Catch

namespace {

namespace examples = kvpack::examples;
namespace quant = kvpack::quant;
using kvpack::ModelShape;

constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;

/// The preset `name`; fails the test when it is missing.
ModelShape shape_of(std::string_view name) {
  const std::optional<examples::NamedModel> model = examples::find_model(name);
  INFO("preset " << std::string(name));
  REQUIRE(model.has_value());
  return model->shape;
}

/// kvpack's own fp16 rate, the one kv_calculator uses for --format f16.
double f16_bits(kvpack::index_t head_dim) {
  return quant::Float<kvpack::half>{}.key.nominal_bits_per_element(head_dim);
}

}  // namespace

TEST_CASE("model presets: shapes match the published configs", "[cache][presets]") {
  // {num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim} as published.
  CHECK(shape_of("Llama-3.1-8B") == ModelShape{32, 32, 8, 128});
  CHECK(shape_of("Llama-3.1-70B") == ModelShape{80, 64, 8, 128});
  CHECK(shape_of("Llama-2-7B") == ModelShape{32, 32, 32, 128});
  CHECK(shape_of("Mistral-7B") == ModelShape{32, 32, 8, 128});
  CHECK(shape_of("Qwen2.5-7B") == ModelShape{28, 28, 4, 128});
  CHECK(shape_of("stories260K") == ModelShape{5, 8, 4, 8});

  CHECK(shape_of("Llama-3.1-8B").group_size() == 4);
  CHECK(shape_of("Llama-2-7B").group_size() == 1);  // MHA
  CHECK(shape_of("Qwen2.5-7B").group_size() == 7);
}

TEST_CASE("model presets: every entry is valid and uniquely named", "[cache][presets]") {
  const auto all = examples::models();
  CHECK(all.size() == 6);
  for (std::size_t i = 0; i < all.size(); ++i) {
    INFO("preset " << std::string(all[i].name));
    CHECK_NOTHROW(all[i].shape.validate());
    CHECK_FALSE(all[i].source.empty());
    // The lookup must give back this very entry, so no two names collide case-insensitively.
    const std::optional<examples::NamedModel> found = examples::find_model(all[i].name);
    REQUIRE(found.has_value());
    CHECK(found->name == all[i].name);
    for (std::size_t j = i + 1; j < all.size(); ++j) CHECK(all[i].name != all[j].name);
  }
}

TEST_CASE("model presets: lookup is case-insensitive and exact", "[cache][presets]") {
  for (const std::string_view spelling : {"Llama-3.1-8B", "llama-3.1-8b", "LLAMA-3.1-8B"}) {
    const std::optional<examples::NamedModel> model = examples::find_model(spelling);
    INFO("spelling " << std::string(spelling));
    REQUIRE(model.has_value());
    CHECK(model->name == "Llama-3.1-8B");
  }
  CHECK(examples::find_model("STORIES260k").has_value());
  CHECK(examples::find_model("qwen2.5-7b").has_value());

  for (const std::string_view unknown :
       {"", "llama", "Llama-3.1-8", "Llama-3.1-8B ", " Llama-3.1-8B", "Llama-3-8B", "gpt-4"}) {
    INFO("name '" << std::string(unknown) << "'");
    CHECK_FALSE(examples::find_model(unknown).has_value());
  }
}

TEST_CASE("kv_bytes: Llama-3.1-8B at 32K tokens in fp16 is exactly 4 GiB", "[cache][presets]") {
  // 2 (K, V) x 32 layers x 8 KV heads x 128 channels x 2 bytes x 32768 tokens.
  const std::uint64_t expected = std::uint64_t{2} * 32 * 8 * 128 * 2 * 32768;
  REQUIRE(expected == (std::uint64_t{1} << 32));
  REQUIRE(expected == 4 * kGiB);

  const ModelShape shape = shape_of("Llama-3.1-8B");
  REQUIRE(f16_bits(shape.head_dim) == 16.0);
  CHECK(examples::kv_bytes(shape, f16_bits(shape.head_dim), 32768, 1) ==
        static_cast<double>(expected));
  // A batch scales linearly.
  CHECK(examples::kv_bytes(shape, 16.0, 32768, 8) == static_cast<double>(8 * expected));
}

TEST_CASE("kv_bytes: Llama-2-7B (MHA) at 4K tokens in fp16 is exactly 2 GiB", "[cache][presets]") {
  // 2 x 32 layers x 32 KV heads x 128 channels x 2 bytes x 4096 tokens.
  const std::uint64_t expected = std::uint64_t{2} * 32 * 32 * 128 * 2 * 4096;
  REQUIRE(expected == 2 * kGiB);

  const ModelShape shape = shape_of("Llama-2-7B");
  CHECK(examples::kv_bytes(shape, f16_bits(shape.head_dim), 4096, 1) ==
        static_cast<double>(expected));
}

TEST_CASE("kv_bytes: q4_0 is fp16 x 4.5/16, q8_0 is fp16 x 8.5/16", "[cache][presets]") {
  for (const examples::NamedModel& model : examples::models()) {
    // q4_0 and q8_0 need whole 32-channel blocks; stories260K (head_dim 8) has none.
    if (model.shape.head_dim % 32 != 0) continue;
    INFO("preset " << std::string(model.name));
    const kvpack::index_t d = model.shape.head_dim;
    const double q4_bits = quant::Q4_0{}.key.nominal_bits_per_element(d);
    const double q8_bits = quant::Q8_0{}.key.nominal_bits_per_element(d);
    REQUIRE(q4_bits == 4.5);  // 18 bytes (fp16 scale + 32 nibbles) per 32 elements
    REQUIRE(q8_bits == 8.5);  // 34 bytes (fp16 scale + 32 int8) per 32 elements

    const double f16 = examples::kv_bytes(model.shape, f16_bits(d), 32768, 3);
    CHECK(examples::kv_bytes(model.shape, q4_bits, 32768, 3) == f16 * 4.5 / 16.0);
    CHECK(examples::kv_bytes(model.shape, q8_bits, 32768, 3) == f16 * 8.5 / 16.0);
  }
  // Llama-3.1-8B, 32K tokens: 4 GiB in fp16 becomes 1.125 GiB in q4_0.
  CHECK(examples::kv_bytes(shape_of("Llama-3.1-8B"), 4.5, 32768, 1) ==
        static_cast<double>(9 * kGiB / 8));
}

TEST_CASE("model presets: stories260K cannot use 32-channel block formats", "[cache][presets]") {
  // kv_calculator prints n/a for q8_0/q4_0 on this preset because the codecs reject it.
  const ModelShape shape = shape_of("stories260K");
  const quant::PageGeometry geometry{32, shape.head_dim};
  CHECK_THROWS_AS(quant::Q8_0{}.key.validate(geometry), kvpack::Error);
  CHECK_THROWS_AS(quant::Q4_0{}.value.validate(geometry), kvpack::Error);
  // 2 x 5 layers x 4 KV heads x 8 channels x 2 bytes x 512 tokens.
  CHECK(examples::kv_bytes(shape, f16_bits(shape.head_dim), 512, 1) ==
        static_cast<double>(std::uint64_t{2} * 5 * 4 * 8 * 2 * 512));
}
