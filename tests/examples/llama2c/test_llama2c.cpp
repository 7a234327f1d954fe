// The llama2c engine: its file loaders on small files written here, and the whole engine on the
// stories260K model against its known output and against the exact (cache-free) forward pass.
// Tests that need the model warn with its path and pass without checking when it is absent.

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "llama2c/checkpoint.hpp"
#include "llama2c/evaluate.hpp"
#include "llama2c/generate.hpp"
#include "llama2c/kv_store.hpp"
#include "llama2c/metrics.hpp"
#include "llama2c/model_files.hpp"
#include "llama2c/name_recall.hpp"
#include "llama2c/tokenizer.hpp"
#include "llama2c/transformer.hpp"

namespace {

using namespace llama2c;
using Catch::Contains;

// ---- small files written by the tests ----

/// Little-endian bytes, appended field by field.
struct Bytes {
  std::vector<char> data;
  template <class T>
  Bytes& add(T value) {
    const auto* raw = reinterpret_cast<const char*>(&value);
    data.insert(data.end(), raw, raw + sizeof(T));
    return *this;
  }
  Bytes& add_text(const std::string& text) {
    data.insert(data.end(), text.begin(), text.end());
    return *this;
  }
};

/// A file in the temp directory, removed when the test ends.
class TempFile {
 public:
  TempFile(const std::string& stem, const std::vector<char>& bytes)
      : path_(std::filesystem::temp_directory_path() / (stem + "_" + std::to_string(std::random_device{}()) + ".bin")) {
    std::ofstream(path_, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  ~TempFile() { std::filesystem::remove(path_); }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// A tiny checkpoint: dim 4, hidden 6, 2 layers, 2 heads, 1 KV head (head_dim 2), vocab 5,
/// seq_len 4, tied classifier.
constexpr std::int32_t kTinyHeader[7] = {4, 6, 2, 2, 1, 5, 4};
// Floats, from the format: embedding 5·4 = 20; per layer 2 norms·4 + wq, wo 2·16 + wk, wv 2·(2·4)
// + w1, w2, w3 3·24 = 128, two layers 256; final norm 4; RoPE tables 4·2 = 8. Total 288.
constexpr int kTinyFloats = 288;

Bytes tiny_checkpoint(const std::int32_t (&header)[7] = kTinyHeader, int floats = kTinyFloats) {
  Bytes bytes;
  for (std::int32_t field : header) bytes.add(field);
  for (int i = 0; i < floats; ++i) bytes.add(0.05f * static_cast<float>(i % 7) - 0.1f);
  return bytes;
}

/// A tokenizer file: unk, BOS, EOS, the 256 byte pieces, then " ", "h", "i", "hi", " hi" with
/// merge scores 0, 0, 0, 1, 2.
/// `hi_score` and `byte_piece` ("<0x%02X>" in llama2.c's files) vary it for the error tests.
Bytes tiny_tokenizer(float hi_score = 1, const char* byte_piece = "<0x%02X>") {
  Bytes bytes;
  bytes.add(std::int32_t{6});
  auto token = [&](const std::string& piece, float score) {
    bytes.add(score).add(static_cast<std::int32_t>(piece.size())).add_text(piece);
  };
  token("<unk>", 0);
  token("\n<s>\n", 0);
  token("\n</s>\n", 0);
  for (int b = 0; b < 256; ++b) {
    char piece[8];
    std::snprintf(piece, sizeof(piece), byte_piece, b);
    token(piece, 0);
  }
  token(" ", 0);
  token("h", 0);
  token("i", 0);
  token("hi", hi_score);
  token(" hi", 2);
  return bytes;
}
constexpr int kTinyTokenizerVocab = 264;

// ---- the real model ----

struct Model {
  Transformer transformer;
  Tokenizer tokenizer;
};

/// stories260K, loaded once per process; nullptr (after a warning naming the path) when absent.
const Model* model_or_warn() {
  static const std::optional<Model> model = []() -> std::optional<Model> {
    const ModelFiles files = model_files(default_model_dir());
    if (!files.present()) return std::nullopt;
    Checkpoint checkpoint = load_checkpoint(files.checkpoint);
    Tokenizer tokenizer = Tokenizer::load(files.tokenizer, checkpoint.config.vocab_size);
    return Model{Transformer(std::move(checkpoint)), std::move(tokenizer)};
  }();
  if (!model) WARN("SKIPPED (model absent): " << missing_model_message(model_files(default_model_dir())));
  return model ? &*model : nullptr;
}

/// The report's benchmark with the default options, built once (it is the slow part).
const Benchmark& shared_benchmark(const Model& m) {
  static const Benchmark benchmark = prepare_benchmark(m.transformer, m.tokenizer, BenchmarkOptions{});
  return benchmark;
}

/// The largest |run − reference| over every logit, as a share of 1e-4 · (1 + |reference|).
double largest_logit_error(const LogitRows& reference, const LogitRows& run) {
  double worst = 0.0;
  for (std::size_t i = 0; i < reference.values.size(); ++i) {
    const double bound = 1e-4 * (1.0 + std::fabs(reference.values[i]));
    worst = std::max(worst, std::fabs(run.values[i] - reference.values[i]) / bound);
  }
  return worst;
}

CacheKvStore f32_cache(const Transformer& model) {
  return CacheKvStore(kvpack::eval::find_policy("f32"), model.kv_shape(), kvpack::CacheConfig{});
}

}  // namespace

// ---- loaders, on files written here (no model needed) ----

TEST_CASE("checkpoint: a well-formed file loads with the header's shapes and a tied classifier", "[llama2c]") {
  const TempFile file("llama2c_tiny", tiny_checkpoint().data);
  const Checkpoint checkpoint = load_checkpoint(file.path());
  CHECK(checkpoint.config.dim == 4);
  CHECK(checkpoint.config.head_dim() == 2);
  CHECK(checkpoint.config.kv_dim() == 2);
  REQUIRE(checkpoint.layers.size() == 2);
  CHECK(checkpoint.layers[1].wk.size() == 2 * 4);
  CHECK(checkpoint.layers[1].w2.size() == 4 * 6);
  CHECK(checkpoint.classifier == checkpoint.token_embedding);
}

TEST_CASE("checkpoint: a truncated or padded file is rejected naming the file and both sizes", "[llama2c]") {
  // 28 header bytes + 288 floats = 1180 bytes.
  const TempFile truncated("llama2c_truncated", tiny_checkpoint(kTinyHeader, kTinyFloats - 1).data);
  CHECK_THROWS_AS(load_checkpoint(truncated.path()), kvpack::Error);
  CHECK_THROWS_WITH(load_checkpoint(truncated.path()), Contains(truncated.path().filename().string()) &&
                                                           Contains("1176 bytes") && Contains("exactly 1180 bytes"));
  const TempFile padded("llama2c_padded", tiny_checkpoint(kTinyHeader, kTinyFloats + 1).data);
  CHECK_THROWS_WITH(load_checkpoint(padded.path()), Contains("1184 bytes") && Contains("exactly 1180 bytes"));
}

TEST_CASE("checkpoint: a bad header, a NaN weight or a missing file is rejected with the reason", "[llama2c]") {
  const TempFile short_file("llama2c_short", std::vector<char>(10, '\0'));
  CHECK_THROWS_WITH(load_checkpoint(short_file.path()), Contains("shorter than the 28-byte"));

  const std::int32_t three_heads[7] = {4, 6, 2, 3, 1, 5, 4};
  const TempFile bad_heads("llama2c_heads", tiny_checkpoint(three_heads).data);
  CHECK_THROWS_WITH(load_checkpoint(bad_heads.path()), Contains("dim 4 is not a multiple of n_heads 3"));

  const std::int32_t no_layers[7] = {4, 6, 0, 2, 1, 5, 4};
  const TempFile zero_layers("llama2c_layers", tiny_checkpoint(no_layers).data);
  CHECK_THROWS_WITH(load_checkpoint(zero_layers.path()), Contains("n_layers = 0"));

  Bytes with_nan = tiny_checkpoint();
  const float nan = std::nanf("");
  // Float 30: after the embedding (20) and both attention norms (8), element 2 of layer 0's wq.
  std::memcpy(with_nan.data.data() + 28 + 4 * 30, &nan, sizeof(nan));
  const TempFile corrupt("llama2c_nan", with_nan.data);
  CHECK_THROWS_WITH(load_checkpoint(corrupt.path()), Contains("layer 0 wq[2] is not finite"));

  // Every field at the 2^20 limit: a file of more than 2^64 bytes (its size used to wrap).
  const std::int32_t huge[7] = {1 << 20, 1 << 20, 1 << 20, 1, 1, 1 << 20, 1 << 20};
  const TempFile wrapping("llama2c_huge", tiny_checkpoint(huge).data);
  CHECK_THROWS_WITH(load_checkpoint(wrapping.path()), Contains("would be more than 2^64 bytes"));

  CHECK_THROWS_WITH(load_checkpoint("/nonexistent/llama2c.bin"),
                    Contains("/nonexistent/llama2c.bin: cannot be opened"));
}

TEST_CASE("model: positions past the context are rejected, not computed", "[llama2c]") {
  const TempFile file("llama2c_context", tiny_checkpoint().data);
  const Transformer model(load_checkpoint(file.path()));
  ExactKvStore kv(model.kv_shape());
  Decoder decoder(model, kv);
  for (int token = 0; token < 4; ++token) decoder.feed(token);  // seq_len 4: positions 0..3
  CHECK_THROWS_WITH(decoder.feed(0), Contains("position 4 is outside the model's context [0, 4)"));
  ExactKvStore fresh(model.kv_shape());
  // BOS and 4 generated tokens use positions 0..3 (the last token is never fed), as run.c allows;
  // a fifth would need position 4.
  CHECK(generate(model, fresh, std::vector<int>{1}, 4).size() == 5);
  ExactKvStore again(model.kv_shape());
  CHECK_THROWS_WITH(generate(model, again, std::vector<int>{1}, 5), Contains("exceed the model's context of 4"));
  CHECK_THROWS_WITH(decoder.feed(5), Contains("token 5 is outside the vocabulary"));
}

TEST_CASE("tokenizer: BOS, dummy prefix, byte fallback and highest-score merges", "[llama2c]") {
  const TempFile file("llama2c_tok", tiny_tokenizer().data);
  const Tokenizer tokenizer = Tokenizer::load(file.path(), kTinyTokenizerVocab);
  // " " + "h" + "i": "hi" (score 1) merges first, then " hi" (score 2).
  CHECK(tokenizer.encode("hi") == std::vector<int>{Tokenizer::kBos, 263});
  CHECK(tokenizer.encode_fragment("hi") == std::vector<int>{262});
  CHECK(tokenizer.encode("") == std::vector<int>{Tokenizer::kBos});
  // "é" (0xC3 0xA9) has no piece: two byte tokens.
  CHECK(tokenizer.encode_fragment("\xC3\xA9") == std::vector<int>{0xC3 + 3, 0xA9 + 3});
  CHECK(tokenizer.decode(tokenizer.encode("hi \xC3\xA9")) == "hi \xC3\xA9");

  std::vector<char> cut = tiny_tokenizer().data;
  cut.resize(cut.size() - 2);  // inside the last piece, " hi"
  const TempFile truncated("llama2c_tok_short", cut);
  CHECK_THROWS_WITH(Tokenizer::load(truncated.path(), kTinyTokenizerVocab), Contains("file ends at byte"));
  CHECK_THROWS_WITH(Tokenizer::load(file.path(), kTinyTokenizerVocab - 1), Contains("bytes follow the last of"));
  const TempFile nan_score("llama2c_tok_nan", tiny_tokenizer(std::nanf("")).data);
  CHECK_THROWS_WITH(Tokenizer::load(nan_score.path(), kTinyTokenizerVocab),
                    Contains("token 262 has a merge score that is not finite"));
  const TempFile lower_case("llama2c_tok_bytes", tiny_tokenizer(1, "<0x%02x>").data);
  CHECK_THROWS_WITH(Tokenizer::load(lower_case.path(), kTinyTokenizerVocab),
                    Contains("token 13 is '<0x0a>', not the byte piece <0x0A>"));
}

// ---- the stories260K model ----

TEST_CASE("tokenizer: stories260K encodes prompts as llama2.c does and decodes them back", "[llama2c][model]") {
  const Model* m = model_or_warn();
  if (m == nullptr) return;
  const Tokenizer& tokenizer = m->tokenizer;
  // " Once", " upon", " a", " time", ",", " there", " was", " a", " little", " do", "g", " named",
  // " S", "p", "ot", ".": merged pieces, far fewer tokens than the 52 characters.
  CHECK(tokenizer.encode("Once upon a time, there was a little dog named Spot.") ==
        std::vector<int>{1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 400, 428, 395, 301, 427, 309, 426});
  CHECK(tokenizer.encode_fragment(" Lily") == std::vector<int>{317});
  for (const std::string text :
       {"Once upon a time, there was a little dog named Spot.", "She said, \"Let's play!\" and they ran to the park.",
        "Caf\xC3\xA9 \xE2\x98\x95 {}~"}) {
    CHECK(tokenizer.decode(tokenizer.encode(text)) == text);
  }
}

TEST_CASE("generation: 200 greedy steps from BOS with the f32 cache tell the known story", "[llama2c][model]") {
  const Model* m = model_or_warn();
  if (m == nullptr) return;
  CacheKvStore kv = f32_cache(m->transformer);
  const std::vector<int> tokens = generate(m->transformer, kv, std::vector<int>{Tokenizer::kBos}, 200);
  CHECK(tokens.size() == 201);
  CHECK_THAT(m->tokenizer.decode(tokens),
             Catch::StartsWith("Once upon a time, there was a little girl named Lily. She loved to play outside in "
                               "the park."));
}

TEST_CASE("oracle: f32 cache logits equal the exact forward pass at every position of 320 tokens", "[llama2c][model]") {
  const Model* m = model_or_warn();
  if (m == nullptr) return;
  const Benchmark& benchmark = shared_benchmark(*m);
  REQUIRE(benchmark.text.size() == 321);
  ExactKvStore exact(m->transformer.kv_shape());
  const LogitRows reference = teacher_forced_logits(m->transformer, exact, benchmark.text);
  // The two runs differ only in attention: the cache's fp32 online softmax against double. Its
  // rounding (~1e-7 relative per step) grows through 5 layers to well under 1e-4 of a logit.
  const double worst = largest_logit_error(reference, benchmark.text_logits);
  INFO("largest |Δlogit| as a share of 1e-4 (1 + |logit|): " << worst);
  CHECK(worst <= 1.0);
  // The fixed text is the f32 cache's own greedy output, so teacher forcing reproduces it.
  const TextScore self = score_text(benchmark.text_logits, benchmark.text_logits, benchmark.text);
  CHECK(self.top1_agreement == 1.0);
  CHECK_FALSE(self.first_divergence.has_value());
  for (std::size_t i = 0; i + 1 < benchmark.text.size(); ++i) {
    REQUIRE(argmax(benchmark.text_logits.row(i)) == benchmark.text[i + 1]);
  }
}

TEST_CASE("prefill: a prompt prefilled into the f32 cache, then decoded, gives the exact forward pass's logits",
          "[llama2c][model]") {
  const Model* m = model_or_warn();
  if (m == nullptr) return;
  const Benchmark& benchmark = shared_benchmark(*m);
  const std::span<const int> text(benchmark.text);
  ExactKvStore exact(m->transformer.kv_shape());
  const LogitRows reference = teacher_forced_logits(m->transformer, exact, text);
  for (const std::size_t prompt : {std::size_t{1}, std::size_t{31}, text.size() / 2, text.size() - 1}) {
    CacheKvStore kv = f32_cache(m->transformer);
    const LogitRows logits = teacher_forced_logits(m->transformer, kv, text, prompt);
    REQUIRE(logits.values.size() == reference.values.size());
    // Prompt rows are the exact pass's own arithmetic; decoded rows differ by the cache's fp32
    // softmax, bounded as in the oracle test above.
    const double worst = largest_logit_error(reference, logits);
    INFO("prompt " << prompt << ": largest |Δlogit| as a share of 1e-4 (1 + |logit|): " << worst);
    CHECK(worst <= 1.0);
    CHECK(kv.cache().length(kv.sequence(), 0) == static_cast<kvpack::index_t>(text.size() - 1));
  }
  CacheKvStore kv = f32_cache(m->transformer);
  CHECK_THROWS_WITH(teacher_forced_logits(m->transformer, kv, text, text.size()), Contains("leaves none of the"));
  Decoder decoder(m->transformer, kv);
  CHECK_THROWS_WITH(decoder.prefill({}), Contains("the prompt is empty"));
  (void)decoder.feed(text[0]);
  CHECK_THROWS_WITH(decoder.prefill(text.subspan(1, 4)), Contains("the prompt must come first, but 1 tokens"));
}

TEST_CASE("prefill: SnapKV evicts at the prefill from the observation window, then keeps every decoded token",
          "[llama2c][model]") {
  const Model* m = model_or_warn();
  if (m == nullptr) return;
  const Benchmark& benchmark = shared_benchmark(*m);
  const std::span<const int> text(benchmark.text);
  const kvpack::index_t budget = 64;
  const kvpack::eval::Policy snapkv = kvpack::eval::find_policy("snapkv").with_budget(budget);
  const std::size_t prompt = 160, decoded = 40;
  CacheKvStore kv(snapkv, m->transformer.kv_shape(), kvpack::CacheConfig{});
  Decoder decoder(m->transformer, kv);
  (void)decoder.prefill(text.first(prompt));
  const kvpack::ModelShape shape = m->transformer.kv_shape();
  // Without the window's queries SnapKV would keep all 160: the budget proves they arrived.
  for (kvpack::index_t layer = 0; layer < shape.layers; ++layer) {
    for (kvpack::index_t head = 0; head < shape.kv_heads; ++head) {
      CHECK(kv.cache().live_tokens(kv.sequence(), layer, head) == budget);
    }
  }
  for (std::size_t i = prompt; i < prompt + decoded; ++i) (void)decoder.feed(text[i]);
  for (kvpack::index_t head = 0; head < shape.kv_heads; ++head) {
    CHECK(kv.cache().live_tokens(kv.sequence(), shape.layers - 1, head) == budget + static_cast<kvpack::index_t>(decoded));
  }
  const PrefilledResult result = evaluate_prefilled(m->transformer, benchmark, snapkv);
  CHECK(result.not_applicable.empty());
  CHECK(result.kept_fraction == Approx(static_cast<double>(budget + text.size() - 1 - text.size() / 2) /
                                       static_cast<double>(text.size() - 1)));
  CHECK(std::isfinite(result.decode_loss));
  CHECK(result.name_question_after < 0.0);
}

TEST_CASE("policies: every builtin runs on the real model or says why it cannot", "[llama2c][model]") {
  const Model* m = model_or_warn();
  if (m == nullptr) return;
  const Benchmark& benchmark = shared_benchmark(*m);
  std::vector<std::pair<std::string, double>> turbo_mse_loss;  // TurboQuant-MSE rows, in registry order
  for (const kvpack::eval::Policy& policy : kvpack::eval::builtin_policies()) {
    const PolicyResult r = evaluate_policy(m->transformer, benchmark, policy);
    INFO(policy.name << ": loss " << r.text.loss << ", delta " << r.loss_delta << ", KL " << r.text.kl << ", top-1 "
                     << r.text.top1_agreement << ", name log p delta " << r.name_log_prob_delta);
    if (policy.name == "q8_0" || policy.name == "q4_0" || policy.name == "q8_0/q4_0" || policy.name == "snapkv+q4_0") {
      // 32-element blocks along head_dim 8.
      CHECK_THAT(r.not_applicable, Contains("head_dim 8 is not a multiple of 32"));
      continue;
    }
    if (policy.name.starts_with("kivi")) {
      // Value groups of 32 channels along head_dim 8 (groups spanning heads are future work).
      CHECK_THAT(r.not_applicable, Contains("head_dim 8 must be a multiple of it"));
      continue;
    }
    REQUIRE(r.not_applicable.empty());
    CHECK(std::isfinite(r.text.loss));
    CHECK(r.text.kl >= 0.0);
    if (policy.name == "f32") {
      CHECK(r.loss_delta == 0.0);
      CHECK(r.text.kl == 0.0);
      CHECK(r.name_log_prob_delta == 0.0);
    }
    if (policy.name.starts_with("turbo") || policy.name == "qjl") {
      // TurboQuant and QJL quantize every paged token at 2.6-4.4 bits; on head_dim 8 the fp16
      // norm alone is 2 bits per element. Measured at page 32 (Δloss, KL, top-1, Δname); bounds
      // 1.5x the errors and 0.1 below the top-1 agreement.
      struct Tier {
        const char* name;
        double loss, kl, top1, name_delta;
      };
      constexpr Tier kTiers[] = {{"turbo-4", 0.092, 0.057, 0.916, 0.94},   {"turbo-3.5", 0.334, 0.257, 0.816, 2.68},
                                 {"turbo-3", 0.606, 0.466, 0.734, 4.59},   {"turbo-2.5", 1.84, 1.52, 0.463, 8.29},
                                 {"turbo-3-prod", 3.42, 3.04, 0.263, 9.72}, {"qjl", 3.48, 3.01, 0.253, 13.14}};
      const auto tier = std::find_if(std::begin(kTiers), std::end(kTiers),
                                     [&](const Tier& t) { return policy.name == t.name; });
      REQUIRE(tier != std::end(kTiers));
      CHECK(std::fabs(r.loss_delta) < 1.5 * tier->loss);
      CHECK(r.text.kl < 1.5 * tier->kl);
      CHECK(r.text.top1_agreement >= tier->top1 - 0.1);
      CHECK(std::fabs(r.name_log_prob_delta) < 1.5 * tier->name_delta);
      if (policy.name != "turbo-3-prod") turbo_mse_loss.emplace_back(policy.name, r.loss_delta);
      continue;
    }
    // Bounds from stories260K at page 32 (the newest < 32 tokens stay in the fp32 tail), each a
    // few times what was measured, so a kernel on another ISA passes but a real regression fails.
    // Measured: 16-bit |Δloss| <= 2.4e-4 nats, KL <= 6.7e-6, top-1 100 %, |Δname| <= 0.002;
    // 8-bit (fp8 e4m3/e5m2, int8) |Δloss| <= 0.012, KL <= 6.5e-3, top-1 >= 95.6 %, |Δname| <= 0.18.
    // KVQuant (pre-RoPE, calibrated on another sampled text): nuq4 and nuq3 measured inside the
    // 8-bit tier (Δloss 0.003 / 0.014); nuq2 Δloss 0.058, KL 0.032, top-1 91.9 %, Δname −0.54.
    if (policy.name == "kvquant-2") {
      CHECK(std::fabs(r.loss_delta) < 0.2);
      CHECK(r.text.kl < 0.1);
      CHECK(r.text.top1_agreement >= 0.8);
      CHECK(std::fabs(r.name_log_prob_delta) < 1.5);
      continue;
    }
    const bool sixteen_bit = policy.name == "f16" || policy.name == "bf16";
    CHECK(std::fabs(r.loss_delta) < (sixteen_bit ? 0.002 : 0.05));
    CHECK(r.text.kl < (sixteen_bit ? 1e-4 : 0.03));
    CHECK(r.text.top1_agreement >= (sixteen_bit ? 0.99 : 0.9));
    CHECK(std::fabs(r.name_log_prob_delta) < (sixteen_bit ? 0.02 : 0.5));
  }
  // Fewer TurboQuant bits never help: turbo-4, -3.5, -3, -2.5 (then qjl) lose more and more.
  for (std::size_t i = 0; i + 1 < turbo_mse_loss.size(); ++i) {
    INFO(turbo_mse_loss[i].first << " vs " << turbo_mse_loss[i + 1].first);
    CHECK(turbo_mse_loss[i].second < turbo_mse_loss[i + 1].second);
  }
}

TEST_CASE("name recall: the f32 cache scores each name as the exact forward pass does", "[llama2c][model]") {
  const Model* m = model_or_warn();
  if (m == nullptr) return;
  const Benchmark& benchmark = shared_benchmark(*m);
  REQUIRE(benchmark.probes.size() == 12);
  for (std::size_t p = 0; p < benchmark.probes.size(); ++p) {
    const NameProbe& probe = benchmark.probes[p];
    INFO(probe.name << ", seed " << probe.seed << ": " << m->tokenizer.decode(probe.tokens));
    CHECK(probe.tokens.size() < 512);
    CHECK(m->tokenizer.decode(std::vector<int>(probe.tokens.begin() + static_cast<std::ptrdiff_t>(probe.name_begin),
                                               probe.tokens.end())) == " " + probe.name);
    ExactKvStore exact(m->transformer.kv_shape());
    const NameScore reference = score_name(m->transformer, exact, probe);
    CHECK(benchmark.probe_scores[p].log_prob == Approx(reference.log_prob).margin(1e-4));
    CHECK(benchmark.probe_scores[p].top1 == reference.top1);
  }
}

TEST_CASE("kv dump: the exact store writes the K/V an f32 cache holds for the same text", "[llama2c][model]") {
  const Model* m = model_or_warn();
  if (m == nullptr) return;
  const std::vector<int> text = m->tokenizer.encode("Once upon a time, there was a little dog named Spot.");
  ExactKvStore exact(m->transformer.kv_shape());
  CacheKvStore cached = f32_cache(m->transformer);
  (void)teacher_forced_logits(m->transformer, exact, text);
  (void)teacher_forced_logits(m->transformer, cached, text);
  const std::string path = (std::filesystem::temp_directory_path() / "kvpack_test_llama2c.kvdump").string();
  exact.write_dump(path);
  kvpack::eval::KVDumpReader reader(path);
  const kvpack::ModelShape shape = m->transformer.kv_shape();
  REQUIRE(reader.header().layers == static_cast<std::uint32_t>(shape.layers));
  REQUIRE(reader.header().tokens == text.size() - 1);  // the last token is never fed
  for (kvpack::index_t layer = 0; layer < shape.layers; ++layer) {
    const kvpack::eval::LayerKV dumped = reader.read_layer(layer);
    for (kvpack::index_t head = 0; head < shape.kv_heads; ++head) {
      // f32 pages and the tail hold their input bits exactly. Layer 0's K/V come from the
      // embeddings alone, so they match bit for bit; deeper layers see attention outputs that
      // differ by fp32-versus-double rounding (the oracle test's 1e-4 bound).
      const kvpack::StoredTokens stored = cached.cache().read_back(cached.sequence(), layer, head);
      REQUIRE(stored.size() == dumped.tokens);
      const double tolerance = layer == 0 ? 0.0 : 1e-4;
      for (kvpack::index_t t = 0; t < dumped.tokens; ++t) {
        for (kvpack::index_t c = 0; c < shape.head_dim; ++c) {
          const float k = stored.keys[static_cast<std::size_t>(t) * shape.head_dim + c];
          const float v = stored.values[static_cast<std::size_t>(t) * shape.head_dim + c];
          REQUIRE(std::fabs(dumped.key(t, head)[c] - k) <= tolerance * (1.0 + std::fabs(k)));
          REQUIRE(std::fabs(dumped.value(t, head)[c] - v) <= tolerance * (1.0 + std::fabs(v)));
        }
      }
    }
  }
  std::filesystem::remove(path);
}
