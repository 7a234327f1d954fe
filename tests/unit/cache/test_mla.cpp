// layout::MLA: one latent stream per layer read by every query head in absorbed form. The cache
// holds DeepSeek-V2's 576 elements per token and layer; absorbed decode equals explicit
// multi-head attention through the up-projections; the latent kernel matches a double-precision
// reference on every ISA for every codec family; prefix sharing and forks work on it; bad
// shapes and options are rejected with a reason.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <string_view>
#include <vector>

#include "kvpack/kernels/attend_latent.hpp"
#include "kvpack/kvpack.hpp"
#include "support/error_bound.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;

/// out[h] = Σ_t softmax_t(scale · q[h]·[c_t ; k^R_t]) c_t in double, over the tokens as stored.
std::vector<double> reference_latent_attention(const StoredTokens& stored, const std::vector<float>& queries,
                                               index_t heads, double scale) {
  const index_t latent = stored.value_dim;
  const index_t rope = stored.key_dim;
  std::vector<double> out(static_cast<std::size_t>(heads) * latent, 0.0);
  for (index_t h = 0; h < heads; ++h) {
    const float* q = queries.data() + static_cast<std::size_t>(h) * (latent + rope);
    std::vector<double> scores(static_cast<std::size_t>(stored.size()));
    for (index_t t = 0; t < stored.size(); ++t) {
      double s = 0.0;
      for (index_t c = 0; c < latent; ++c) s += static_cast<double>(q[c]) * stored.values[t * latent + c];
      for (index_t c = 0; c < rope; ++c) s += static_cast<double>(q[latent + c]) * stored.keys[t * rope + c];
      scores[t] = s * scale;
    }
    const double top = *std::max_element(scores.begin(), scores.end());
    double sum = 0.0;
    for (index_t t = 0; t < stored.size(); ++t) {
      const double p = std::exp(scores[t] - top);
      sum += p;
      for (index_t c = 0; c < latent; ++c) out[h * latent + c] += p * stored.values[t * latent + c];
    }
    for (index_t c = 0; c < latent; ++c) out[h * latent + c] /= sum;
  }
  return out;
}

/// The tokens one head attends over, as support/error_bound.hpp bounds them: keys [c ; k^R]
/// (scored in fp32 from the decoded tile), values c, in pages of `page_size` then the tail.
test::DecodedTokens decoded_tokens(const StoredTokens& stored, index_t page_size, index_t full_pages) {
  test::DecodedTokens tokens;
  tokens.page_size = page_size;
  tokens.page_max_value.assign(static_cast<std::size_t>(full_pages), 0.0);
  const index_t latent = stored.value_dim;
  const index_t rope = stored.key_dim;
  for (index_t t = 0; t < stored.size(); ++t) {
    std::vector<float> key(stored.values.begin() + t * latent, stored.values.begin() + (t + 1) * latent);
    key.insert(key.end(), stored.keys.begin() + t * rope, stored.keys.begin() + (t + 1) * rope);
    tokens.keys.push_back(std::move(key));
    tokens.values.emplace_back(stored.values.begin() + t * latent, stored.values.begin() + (t + 1) * latent);
    const int page = t < full_pages * page_size ? static_cast<int>(t / page_size) : -1;
    tokens.page_of.push_back(page);
    if (page >= 0) {
      for (float x : tokens.values.back()) {
        tokens.page_max_value[page] = std::max(tokens.page_max_value[page], static_cast<double>(std::fabs(x)));
      }
    }
  }
  return tokens;
}

/// Latents with an outlier channel block and a zero row, RoPE keys with large leading channels.
struct LatentRows {
  std::vector<float> latents, rope_keys;
};
LatentRows latent_rows(index_t tokens, index_t latent, index_t rope, std::uint32_t seed) {
  LatentRows rows{test::random_rows(tokens, latent, seed, 4, 8.0f), test::random_rows(tokens, rope, seed + 1, 2, 5.0f)};
  if (tokens > 5) {
    std::fill_n(rows.latents.begin() + 5 * latent, latent, 0.0f);
    std::fill_n(rows.rope_keys.begin() + 5 * rope, rope, 0.0f);
  }
  return rows;
}

/// One layer's latent stream of a cache, as the kernel reads it: its pages, the tail (the stored
/// rows after the last whole page), the codecs with their parameters.
template <class Cache>
struct LatentStream {
  using Quantizer = typename Cache::quantizer_type;
  std::vector<const std::byte*> payloads;
  std::vector<float> tail_keys, tail_values;
  Quantizer quantizer{};
  kernels::PageRun run;
  kernels::TailView tail;
  kernels::LatentCodecs<typename Quantizer::key_codec, typename Quantizer::value_codec> codecs;
  index_t pages = 0;

  LatentStream(const Cache& cache, SeqId seq, const StoredTokens& stored) {
    const index_t page_size = cache.config().page_size;
    const index_t latent = stored.value_dim, rope = stored.key_dim;
    const std::span<const PageId> table = cache.pages(seq, 0, 0);
    for (PageId id : table) payloads.push_back(cache.pool().payload(id));
    pages = static_cast<index_t>(table.size());
    const index_t paged = pages * page_size;
    tail_keys.assign(stored.keys.begin() + paged * rope, stored.keys.end());
    tail_values.assign(stored.values.begin() + paged * latent, stored.values.end());
    tail = {tail_keys.data(), tail_values.data(), stored.size() - paged, nullptr};
    run = {payloads.data(), nullptr, pages, 0, page_size, latent, cache.value_plane_offset(),
           cache.page_format_info().payload_bytes};
    const auto [rope_params, latent_params] = cache.codec_params(0, 0);
    codecs = {&quantizer.key, rope_params, &quantizer.value, latent_params};
  }
  LatentStream(const LatentStream&) = delete;  // codecs point into quantizer
};

template <class Quantizer>
void check_latent_kernel_on_every_isa(index_t q_heads, index_t latent, index_t rope, index_t page_size,
                                      index_t tokens, std::uint32_t seed) {
  using Cache = KVCache<layout::MLA, Quantizer>;
  using KeyCodec = typename Quantizer::key_codec;
  using ValueCodec = typename Quantizer::value_codec;
  const ModelShape shape{1, q_heads, 1, 128};
  CacheConfig config;
  config.page_size = page_size;
  Cache cache(shape, config, Quantizer{}, layout::MLA{latent, rope});
  const SeqId seq = cache.add_sequence();
  const LatentRows rows = latent_rows(tokens, latent, rope, seed);
  cache.prefill(seq, 0, std::span<const float>(rows.rope_keys), std::span<const float>(rows.latents));
  const StoredTokens stored = cache.read_back(seq, 0, 0);
  REQUIRE(stored.size() == tokens);

  const auto queries = test::random_rows(q_heads, latent + rope, seed + 2);
  const float scale = 1.0f / std::sqrt(static_cast<float>(latent + rope));
  const std::vector<double> expected = reference_latent_attention(stored, queries, q_heads, scale);

  // The kernel on the cache's own pages and tail.
  const LatentStream<Cache> stream(cache, seq, stored);
  const kernels::TailView& tail = stream.tail;
  std::vector<float> scaled(queries.size());
  std::transform(queries.begin(), queries.end(), scaled.begin(), [&](float x) { return x * scale; });
  test::DecodedTokens decoded = decoded_tokens(stored, page_size, stream.pages);
  for (const std::byte* payload : stream.payloads) {  // what KIVI's integer value bound needs
    test::add_value_code_mass(stream.quantizer.value, stream.codecs.latent_params,
                              quant::PageGeometry{page_size, latent}, payload + stream.run.value_offset, decoded);
  }

  // Per head, the bound for fp32 value sums and for the codec's integer value operands (the
  // value kernel's path on AVX-512, and int8's, q8_0's and q4_0's on AVX2); keys are scored in
  // fp32 from the decoded tile either way.
  std::vector<double> float_bound(static_cast<std::size_t>(q_heads)), integer_bound(float_bound.size());
  for (index_t h = 0; h < q_heads; ++h) {
    const float* q = scaled.data() + static_cast<std::size_t>(h) * (latent + rope);
    float_bound[h] = test::attention_error_bound(decoded, q, latent + rope, 1.0, test::Operands::kFloat,
                                                 test::Operands::kFloat);
    integer_bound[h] = test::attention_error_bound(decoded, q, latent + rope, 1.0, test::Operands::kFloat,
                                                   test::operands<ValueCodec>("avx512"));
  }
  // The largest error of each head, over its bound (at most 1 passes).
  const auto worst_ratio = [&](const std::vector<float>& out, std::string_view isa) {
    const bool integer = test::operands<ValueCodec>(isa) != test::Operands::kFloat;
    double worst = 0.0;
    for (index_t h = 0; h < q_heads; ++h) {
      const double bound = integer ? integer_bound[h] : float_bound[h];
      for (index_t c = 0; c < latent; ++c) {
        const std::size_t i = static_cast<std::size_t>(h) * latent + c;
        const double error = std::fabs(out[i] - expected[i]);
        worst = std::max(worst, std::isfinite(error) ? error / bound : 1e30);
      }
    }
    return worst;
  };

  kernels::Workspace workspace;
  workspace.prepare(q_heads, latent + rope, page_size, tail.count);
  std::vector<float> tile(kernels::latent_tile_floats(page_size, latent, rope, tail.count));
  int isas = 0;
  kernels::cpu::cpu_archs::for_each([&](auto arch) {
    using Arch = decltype(arch);
    if (!kernels::cpu::cpu_supports<Arch>()) return;
    ++isas;
    std::vector<float> out(static_cast<std::size_t>(q_heads) * latent, -1.0f);
    kernels::attend_latent_stream(stream.run, rope, stream.codecs, tail, scaled.data(), q_heads, out.data(), workspace,
                                  tile.data(), kernels::LatentKernelSet<KeyCodec, ValueCodec>::template for_arch<Arch>());
    INFO(Quantizer::name() << " isa " << kernels::cpu::isa_name<Arch>() << " heads=" << q_heads << " latent="
                           << latent << " rope=" << rope << " P=" << page_size << " tokens=" << tokens);
    CHECK(worst_ratio(out, kernels::cpu::isa_name<Arch>()) <= 1.0);
  });
  CHECK(isas >= 1);

  // attend() itself, with the kernels dispatch picks.
  std::vector<float> out(static_cast<std::size_t>(q_heads) * latent);
  cache.attend(seq, 0, std::span<const float>(queries), std::span<float>(out), scale);
  CHECK(worst_ratio(out, dispatch::active_cpu_isa()) <= 1.0);

  // And split over threads: runs of pages on a pool, their softmax states merged.
  ThreadPool threads(3);
  CacheConfig split_config = config;
  split_config.executor = [&threads](index_t count, const std::function<void(index_t)>& task) { threads(count, task); };
  Cache split(shape, split_config, Quantizer{}, layout::MLA{latent, rope});
  const SeqId split_seq = split.add_sequence();
  split.prefill(split_seq, 0, std::span<const float>(rows.rope_keys), std::span<const float>(rows.latents));
  std::vector<float> split_out(out.size());
  split.attend(split_seq, 0, std::span<const float>(queries), std::span<float>(split_out), scale);
  CHECK(worst_ratio(split_out, dispatch::active_cpu_isa()) <= 1.0);
}

}  // namespace

TEMPLATE_TEST_CASE("the latent kernel matches the double-precision reference on every ISA", "[cache][mla][kernels]",
                   (quant::MLA<quant::Float<half>>), (quant::MLA<quant::Float<float>, quant::Float<float>>),
                   (quant::MLA<quant::FP8<quant::E4M3FN>>), (quant::MLA<quant::Int8>), (quant::MLA<quant::Q8_0>),
                   (quant::MLA<quant::Q4_0>), (quant::MLA<quant::KIVI<2, 32>>), (quant::MLA<quant::Q8_0, quant::Q8_0>)) {
  // Small shapes with a tail of any length; then DeepSeek-V2's (128 heads, 512 + 64).
  check_latent_kernel_on_every_isa<TestType>(8, 64, 32, 16, 100, 11);
  check_latent_kernel_on_every_isa<TestType>(5, 32, 32, 32, 20, 12);  // tail only
  check_latent_kernel_on_every_isa<TestType>(4, 32, 32, 16, 2000, 14);  // 4 chunks: 4 runs on threads
  check_latent_kernel_on_every_isa<TestType>(128, 512, 64, 64, 600, 13);  // a chunk of 512, a page, a tail
}

TEST_CASE("the latent kernel carries NaN and Inf like the reference on every ISA", "[cache][mla][kernels]") {
  // Unchecked input (check_inputs off) in fp32 planes: +Inf in a latent (it scores +Inf for heads
  // whose query is positive there, so their softmax is exp(inf - inf) = NaN; the others weigh it
  // 0, and 0 · inf = NaN in that channel) and -Inf in a RoPE key (the same by the query's sign,
  // without the value). A NaN anywhere would make every output NaN: no test of agreement.
  using Quantizer = quant::MLA<quant::Float<float>, quant::Float<float>>;
  const index_t heads = 8, latent = 32, rope = 16, page = 16, tokens = 40;
  CacheConfig config;
  config.page_size = page;
  config.check_inputs = false;
  KVCache<layout::MLA, Quantizer> cache(ModelShape{1, heads, 1, 64}, config, {}, layout::MLA{latent, rope});
  LatentRows rows = latent_rows(tokens, latent, rope, 90);
  rows.latents[3 * latent + 7] = std::numeric_limits<float>::infinity();
  rows.rope_keys[37 * rope + 2] = -std::numeric_limits<float>::infinity();  // in the tail
  const SeqId seq = cache.add_sequence();
  cache.prefill(seq, 0, std::span<const float>(rows.rope_keys), std::span<const float>(rows.latents));
  const StoredTokens stored = cache.read_back(seq, 0, 0);
  const auto queries = test::random_rows(heads, latent + rope, 91);
  const std::vector<double> expected = reference_latent_attention(stored, queries, heads, 0.2);

  const LatentStream<decltype(cache)> stream(cache, seq, stored);
  const kernels::TailView& tail = stream.tail;
  std::vector<float> scaled(queries.size());
  std::transform(queries.begin(), queries.end(), scaled.begin(), [](float x) { return x * 0.2f; });
  kernels::Workspace workspace;
  workspace.prepare(heads, latent + rope, page, tail.count);
  std::vector<float> tile(kernels::latent_tile_floats(page, latent, rope, tail.count));
  int non_finite = 0;
  for (double x : expected) non_finite += std::isfinite(x) ? 0 : 1;
  REQUIRE(non_finite > 0);
  REQUIRE(non_finite < static_cast<int>(expected.size()));
  kernels::cpu::cpu_archs::for_each([&](auto arch) {
    using Arch = decltype(arch);
    if (!kernels::cpu::cpu_supports<Arch>()) return;
    std::vector<float> out(static_cast<std::size_t>(heads) * latent);
    kernels::attend_latent_stream(
        stream.run, rope, stream.codecs, tail, scaled.data(), heads, out.data(), workspace, tile.data(),
        kernels::LatentKernelSet<Quantizer::key_codec, Quantizer::value_codec>::template for_arch<Arch>());
    INFO("isa " << kernels::cpu::isa_name<Arch>());
    int mismatched = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      // Non-finite where the reference is; finite ones to fp32 rounding of the finite sums.
      const bool agree = std::isfinite(expected[i])
                             ? std::isfinite(out[i]) && std::fabs(out[i] - expected[i]) <= 1e-4 * (1.0 + std::fabs(expected[i]))
                             : !std::isfinite(out[i]);
      mismatched += agree ? 0 : 1;
    }
    CHECK(mismatched == 0);
  });
}

TEST_CASE("a head whose query is NaN comes out NaN whether its pages run on one thread or several", "[cache][mla]") {
  // Every score of head 0 is NaN: one pass leaves its maximum at -inf and its sum NaN, so the
  // output is NaN; merging passes took that maximum for "no token seen" and wrote 0 (until
  // 2026-12-07). The other heads agree between the two.
  using Quantizer = quant::MLA<quant::Float<float>, quant::Float<float>>;
  const index_t heads = 4, latent = 32, rope = 32, page = 16, tokens = 2000;  // 4 chunks: 4 runs on threads
  CacheConfig config;
  config.page_size = page;
  config.check_inputs = false;
  ThreadPool threads(3);
  CacheConfig split_config = config;
  split_config.executor = [&threads](index_t count, const std::function<void(index_t)>& task) { threads(count, task); };
  using Cache = KVCache<layout::MLA, Quantizer>;
  Cache single(ModelShape{1, heads, 1, 64}, config, {}, layout::MLA{latent, rope});
  Cache split(ModelShape{1, heads, 1, 64}, split_config, {}, layout::MLA{latent, rope});
  const LatentRows rows = latent_rows(tokens, latent, rope, 92);
  auto queries = test::random_rows(heads, latent + rope, 93);
  queries[0] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> one(static_cast<std::size_t>(heads) * latent), many(one.size());
  for (auto [cache, out] : {std::pair{&single, &one}, std::pair{&split, &many}}) {
    const SeqId seq = cache->add_sequence();
    cache->prefill(seq, 0, std::span<const float>(rows.rope_keys), std::span<const float>(rows.latents));
    cache->attend(seq, 0, std::span<const float>(queries), std::span<float>(*out), 0.2f);
  }
  for (index_t c = 0; c < latent; ++c) {
    CHECK(std::isnan(one[static_cast<std::size_t>(c)]));
    CHECK(std::isnan(many[static_cast<std::size_t>(c)]));
  }
  for (std::size_t i = static_cast<std::size_t>(latent); i < one.size(); ++i) {
    CHECK(std::isfinite(many[i]));
    CHECK(many[i] == Approx(one[i]).margin(1e-5));
  }
}

TEST_CASE("MLA holds DeepSeek-V2's 576 elements per token and layer, 57x fewer bytes than MHA", "[cache][mla]") {
  // DeepSeek-V2: 128 heads of 128 channels; latent 512, decoupled RoPE key 64.
  const ModelShape shape{2, 128, 1, 128};
  CacheConfig config;
  config.page_size = 64;
  KVCache<layout::MLA, quant::MLA<quant::Float<half>>> mla(shape, config);
  KVCache<layout::GQA, quant::Float<half>> mha(ModelShape{2, 128, 128, 128}, config);
  const SeqId a = mla.add_sequence();
  const SeqId b = mha.add_sequence();
  const index_t tokens = 128;  // two whole pages
  for (index_t layer = 0; layer < 2; ++layer) {
    const LatentRows rows = latent_rows(tokens, 512, 64, 40 + layer);
    mla.prefill(a, layer, std::span<const float>(rows.rope_keys), std::span<const float>(rows.latents));
    const auto kv = test::random_rows(static_cast<std::size_t>(tokens) * 128, 128, 50 + layer);
    mha.prefill(b, layer, std::span<const float>(kv), std::span<const float>(kv));
  }
  const double token_layers = 2.0 * tokens;
  // fp16 latent + bf16 RoPE key: (512 + 64) · 2 bytes, no padding (the RoPE plane is 8 KiB).
  CHECK(mla.memory().page_payload / token_layers == 576.0 * 2);
  CHECK(mha.memory().page_payload / token_layers == 2.0 * 128 * 128 * 2);
  CHECK(mha.memory().page_payload / static_cast<double>(mla.memory().page_payload) == Approx(32768.0 / 576));
  CHECK(mla.memory().stored_elements == static_cast<std::size_t>(token_layers) * 576);
}

TEST_CASE("absorbed MLA decode equals multi-head attention through the up-projections", "[cache][mla]") {
  // Per head i: k_i = [W_UK_i c ; k^R], v_i = W_UV_i c (explicit, cached per head as MHA), versus
  // the absorbed query [W_UK_iᵀ q_i ; q^R_i] over the cached [c ; k^R] and out_i = W_UV_i · o_i.
  const index_t heads = 4, latent = 32, rope = 16, nope = 16, tokens = 150;
  const index_t head_dim = nope + rope;  // also the explicit value width
  const auto w_uk = test::random_rows(static_cast<std::size_t>(heads) * nope, latent, 60);      // [h][nope][latent]
  const auto w_uv = test::random_rows(static_cast<std::size_t>(heads) * head_dim, latent, 61);  // [h][d][latent]
  const LatentRows rows = latent_rows(tokens, latent, rope, 62);
  const auto q = test::random_rows(heads, head_dim, 63);  // [h][q_nope ; q_rope]
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));

  CacheConfig config;
  config.page_size = 16;
  KVCache<layout::GQA, quant::Float<float>> explicit_heads(ModelShape{1, heads, heads, head_dim}, config);
  std::vector<float> keys(static_cast<std::size_t>(tokens) * heads * head_dim);
  std::vector<float> values(keys.size());
  for (index_t t = 0; t < tokens; ++t) {
    for (index_t h = 0; h < heads; ++h) {
      float* k = keys.data() + (static_cast<std::size_t>(t) * heads + h) * head_dim;
      float* v = values.data() + (static_cast<std::size_t>(t) * heads + h) * head_dim;
      const float* c = rows.latents.data() + static_cast<std::size_t>(t) * latent;
      for (index_t r = 0; r < head_dim; ++r) {
        double up_k = 0.0, up_v = 0.0;
        for (index_t j = 0; j < latent; ++j) {
          if (r < nope) up_k += static_cast<double>(w_uk[(h * nope + r) * latent + j]) * c[j];
          up_v += static_cast<double>(w_uv[(h * head_dim + r) * latent + j]) * c[j];
        }
        k[r] = r < nope ? static_cast<float>(up_k) : rows.rope_keys[t * rope + (r - nope)];
        v[r] = static_cast<float>(up_v);
      }
    }
  }
  const SeqId e = explicit_heads.add_sequence();
  explicit_heads.prefill(e, 0, std::span<const float>(keys), std::span<const float>(values));
  std::vector<float> expected(q.size());
  explicit_heads.attend(e, 0, std::span<const float>(q), std::span<float>(expected), scale);

  KVCache<layout::MLA, quant::MLA<quant::Float<float>, quant::Float<float>>> absorbed(
      ModelShape{1, heads, 1, head_dim}, config, {}, layout::MLA{latent, rope});
  const SeqId m = absorbed.add_sequence();
  absorbed.prefill(m, 0, std::span<const float>(rows.rope_keys), std::span<const float>(rows.latents));
  std::vector<float> absorbed_query(static_cast<std::size_t>(heads) * (latent + rope));
  for (index_t h = 0; h < heads; ++h) {
    for (index_t j = 0; j < latent; ++j) {
      double sum = 0.0;
      for (index_t r = 0; r < nope; ++r) sum += static_cast<double>(w_uk[(h * nope + r) * latent + j]) * q[h * head_dim + r];
      absorbed_query[h * (latent + rope) + j] = static_cast<float>(sum);
    }
    for (index_t r = 0; r < rope; ++r) absorbed_query[h * (latent + rope) + latent + r] = q[h * head_dim + nope + r];
  }
  std::vector<float> latent_out(static_cast<std::size_t>(heads) * latent);
  absorbed.attend(m, 0, std::span<const float>(absorbed_query), std::span<float>(latent_out), scale);

  double max_value = 0.0;
  for (float x : values) max_value = std::max(max_value, static_cast<double>(std::fabs(x)));
  for (index_t h = 0; h < heads; ++h) {
    for (index_t r = 0; r < head_dim; ++r) {
      double up = 0.0;
      for (index_t j = 0; j < latent; ++j) up += static_cast<double>(w_uv[(h * head_dim + r) * latent + j]) * latent_out[h * latent + j];
      // Both sides round the scores in fp32 sums of different lengths (16 + 16 vs 32 + 16
      // products, |q|,|k| ~ 10): the weights agree to ~1e-5 relative, the outputs to that of max|v|.
      CHECK(std::fabs(up - expected[h * head_dim + r]) <= 1e-4 * max_value);
    }
  }
}

TEST_CASE("MLA caches share prompt prefixes and fork like GQA ones", "[cache][mla][prefix]") {
  const ModelShape shape{1, 8, 1, 128};
  CacheConfig config;
  config.page_size = 16;
  config.prefix_sharing = PrefixSharing{"mla-test"};
  using Cache = KVCache<layout::MLA, quant::MLA<quant::Q8_0>>;
  Cache cache(shape, config, {}, layout::MLA{64, 32});
  std::vector<paging::TokenId> prompt(70);
  std::iota(prompt.begin(), prompt.end(), 1);
  const LatentRows rows = latent_rows(70, 64, 32, 70);
  const SeqId first = cache.add_sequence(prompt).seq;
  cache.prefill(first, 0, std::span<const float>(rows.rope_keys), std::span<const float>(rows.latents));
  cache.share_prefix(first);
  const PrefixHit hit = cache.add_sequence(prompt);
  CHECK(hit.cached_tokens == 64);
  cache.prefill(hit.seq, 0, std::span<const float>(rows.rope_keys).subspan(64 * 32),
                std::span<const float>(rows.latents).subspan(64 * 64));
  const SeqId forked = cache.fork(first);
  const auto q = test::random_rows(8, 96, 71);
  std::vector<float> a(8 * 64), b(8 * 64), c(8 * 64);
  cache.attend(first, 0, std::span<const float>(q), std::span<float>(a), 0.1f);
  cache.attend(hit.seq, 0, std::span<const float>(q), std::span<float>(b), 0.1f);
  cache.attend(forked, 0, std::span<const float>(q), std::span<float>(c), 0.1f);
  CHECK(a == b);
  CHECK(a == c);
  CHECK(cache.prefix_stats().hit_tokens == 64);
}

TEST_CASE("MLA rejects what it cannot hold, with a reason", "[cache][mla][errors]") {
  using Cache = KVCache<layout::MLA, quant::MLA<quant::Float<half>>>;
  CHECK_THROWS_WITH(Cache(ModelShape{1, 8, 2, 128}), Catch::Contains("kv_heads must be 1"));
  CHECK_THROWS_WITH(Cache(ModelShape{1, 8, 1, 128}, {}, {}, layout::MLA{0, 64}),
                    Catch::Contains("latent_dim and rope_dim in [1, 16384], got 0 and 64"));
  // Widths whose sum would overflow the query's width, or that no page file could hold.
  CHECK_THROWS_WITH(Cache(ModelShape{1, 8, 1, 128}, {}, {}, layout::MLA{std::numeric_limits<index_t>::max(), 1}),
                    Catch::Contains("in [1, 16384]"));
  CHECK_THROWS_WITH(Cache(ModelShape{1, 8, 1, 128}, {}, {}, layout::MLA{512, 16385}), Catch::Contains("in [1, 16384]"));
  CacheConfig pre_rope;
  pre_rope.key_rope = RopeSpec{};
  CHECK_THROWS_WITH(Cache(ModelShape{1, 8, 1, 128}, pre_rope), Catch::Contains("key_rope must be unset"));
  // A codec's own limits apply to its plane: q4_0 blocks of 32 along the 48-wide latent do not fit.
  CHECK_THROWS_AS((KVCache<layout::MLA, quant::MLA<quant::Q4_0>>(ModelShape{1, 8, 1, 128}, {}, {}, layout::MLA{48, 64})),
                  Error);

  Cache cache(ModelShape{1, 8, 1, 128}, {}, {}, layout::MLA{64, 32});
  const SeqId seq = cache.add_sequence();
  const LatentRows rows = latent_rows(10, 64, 32, 80);
  // Keys and values swapped: 10 rows of 64 are not rows of rope_dim 32 with 10 latents of 64.
  CHECK_THROWS_WITH(cache.prefill(seq, 0, std::span<const float>(rows.latents), std::span<const float>(rows.rope_keys)),
                    Catch::Contains("values must hold 1280 elements (20 tokens of latent_dim)"));
  // The keys' rows are rope_dim wide (32), not head_dim (128), and the message says so.
  CHECK_THROWS_WITH(cache.prefill(seq, 0, std::span<const float>(rows.rope_keys).first(33),
                                  std::span<const float>(rows.latents)),
                    Catch::Contains("rows of rope_dim (layout::MLA) = 32 elements, got 33"));
  const std::vector<float> observation(8 * 128);
  CHECK_THROWS_WITH(cache.prefill(seq, 0, std::span<const float>(rows.rope_keys), std::span<const float>(rows.latents),
                                  std::span<const float>(observation)),
                    Catch::Contains("observation_queries must be empty"));
  CHECK(cache.length(seq, 0) == 0);
  cache.prefill(seq, 0, std::span<const float>(rows.rope_keys), std::span<const float>(rows.latents));
  std::vector<float> q(8 * 64), out(8 * 64);  // a query without its RoPE part
  CHECK_THROWS_WITH(cache.attend(seq, 0, std::span<const float>(q), std::span<float>(out), 0.1f),
                    Catch::Contains("q_heads * (latent_dim + rope_dim) = 768 and q_heads * latent_dim = 512"));
  CHECK_THROWS_WITH(cache.append(seq, 0, std::span<const float>(q.data(), 64), std::span<const float>(q.data(), 64), 10),
                    Catch::Contains("rope_dim = 32 and latent_dim = 64"));
}
