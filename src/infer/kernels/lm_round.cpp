// infer::draft_lm_round: a lone row's round of a draft LM (proposers.draft_model.DraftModelProposer) in one call.
//
// A draft step of the distilled LM (4 layers of 192, SmolLM2's vocabulary) was a compiled graph entered through
// Python and Dynamo's guards, then the draw's few ATen ops, each run cold after the verify streamed the target's
// weights: ~1.3 ms a step (c ~0.25 of a decode step) for ~4 MB of weights and ~4 M multiply-adds. This op is
// eagle_round.cpp's way for a Llama stack: the same kernels (qlinear, rms_norm, rope, silu_mul, attention, linear)
// over pointers, the whole round (the catch-up entries, the first draw, every later step) in one call that makes no
// tensor but its two outputs.
//
// The same numerics as the module's steps (LlamaForCausalLM.forward, then DraftVocab.logits), entry by entry: every
// product, norm, rotation, SiLU and the attention are the same kernels, which give a row the same bits whatever rows
// share a call; a residual add is ATen's bfloat16 add; the scores are the quantized rows' product in bfloat16 read as
// float32, then the added rows' (a prompt's tokens outside the vocabulary: infer::linear), as the module's cat.
// Every entry of the catch-up step goes through every layer (a later layer's keys are its outputs); the final norm
// and the draw read the last. The draw is eagle_round.cpp's (round.h): greedy the first maximum, a sampled row
// inverse_cdf(q, u) with q = softmax(logits / T), q returned (a greedy round's at T = 1) as the law drawn from.
#include <cstring>
#include <vector>

#include "ops.h"
#include "round.h"

namespace {

namespace draft_round = infer_kernels::draft_round;
using infer_kernels::draft_round::add_into;
using infer_kernels::draft_round::BF;
using infer_kernels::draft_round::draw;

// the calling thread's working rows (no allocation after its first round)
struct Scratch {
  std::vector<BF> x, normed, qkv, qk, o, a, gu, act, extra;
  std::vector<float> logits;
  std::vector<int64_t> rows;
};

}  // namespace

// tokens [T] int64 at positions start .. start + T - 1 (the entries the drafter has not seen), then S - 1 steps each
// feeding the draft before -> (drafts [1, S] token ids, q [1, S, N] over the vocabulary's columns). packed, formats,
// outs: 4 products a layer (qkv, o, gate_up, down); norms: 2 a layer (input, post-attention) and the final one; the
// vocabulary: its first rows quantized (vocab_packed), the rest extra_weight [E, H] bfloat16, column j token
// vocab_ids[j]. k_caches, v_caches: each layer's paged storage [R, Hkv, D], addressed through the row's block table
// (the pool has taken the blocks and advanced the row's length: PagedKVCachePool.extend).
std::tuple<at::Tensor, at::Tensor> infer_kernels::draft_lm_round(
    const at::Tensor& tokens, at::TensorList packed, at::IntArrayRef formats, at::IntArrayRef outs,
    at::TensorList norms, double eps, const at::Tensor& embed, const at::Tensor& vocab_packed, int64_t vocab_format,
    const std::optional<at::Tensor>& extra_weight, const at::Tensor& vocab_ids, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& table,
    int64_t block_size, int64_t start, int64_t heads, int64_t kv_heads, int64_t head_dim,
    const at::Tensor& temperature, const at::Tensor& u) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(v_caches.size()) == layers &&
              static_cast<int64_t>(packed.size()) == 4 * layers && static_cast<int64_t>(formats.size()) == 4 * layers &&
              static_cast<int64_t>(outs.size()) == 4 * layers && static_cast<int64_t>(norms.size()) == 2 * layers + 1,
              "infer::draft_lm_round: per layer a cache, 4 products (qkv, o, gate_up, down) and 2 norms, and a final "
              "norm expected");
  auto bf16 = [](const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kBFloat16; };
  bool caches_ok = true;
  for (int64_t l = 0; l < layers; ++l)
    caches_ok &= bf16(k_caches[l]) && bf16(v_caches[l]) && k_caches[l].is_contiguous() &&
                 v_caches[l].is_contiguous() && k_caches[l].dim() == 3 && k_caches[l].size(1) == kv_heads &&
                 k_caches[l].size(2) == head_dim && k_caches[l].sizes() == v_caches[l].sizes() &&
                 k_caches[l].size(0) == k_caches[0].size(0);
  TORCH_CHECK(caches_ok, "infer::draft_lm_round: each layer's cache contiguous bfloat16 [R, ", kv_heads, ", ",
              head_dim, "] expected (written in place)");
  bool norms_ok = true;
  const int64_t H = embed.size(1);
  for (const auto& n : norms) norms_ok &= bf16(n) && n.numel() == H;
  TORCH_CHECK(norms_ok && bf16(embed) && bf16(cos) && bf16(sin) && embed.dim() == 2,
              "infer::draft_lm_round: bfloat16 embedding [V, H], norms [H] and rotary tables expected");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && vocab_ids.scalar_type() == at::kLong &&
              table.scalar_type() == at::kLong,
              "infer::draft_lm_round: int64 tokens, vocabulary ids and table expected");
  const int64_t T = tokens.numel(), S = u.size(1), D = head_dim, N = vocab_ids.numel();
  const int64_t q_size = heads * D, kv_size = kv_heads * D, qkv_w = q_size + 2 * kv_size, qk_w = q_size + kv_size;
  const int64_t E = extra_weight.has_value() && extra_weight->defined() ? extra_weight->size(0) : 0;
  const int64_t base_n = N - E;
  const int64_t I = outs[2] / 2;  // the MLP's width (gate | up), every layer's
  bool outs_ok = outs[2] % 2 == 0;
  for (int64_t l = 0; l < layers; ++l)
    outs_ok &= outs[4 * l] == qkv_w && outs[4 * l + 1] == H && outs[4 * l + 2] == outs[2] && outs[4 * l + 3] == H;
  TORCH_CHECK(tokens.dim() == 1 && T >= 1 && S >= 1 && u.dim() == 2 && u.size(0) == 1 &&
              u.scalar_type() == at::kDouble && temperature.numel() == 1 && outs_ok && base_n >= 1 &&
              (E == 0 || (bf16(*extra_weight) && extra_weight->dim() == 2 && extra_weight->size(1) == H)) &&
              cos.dim() == 2 && cos.size(1) == D && cos.sizes() == sin.sizes(),
              "infer::draft_lm_round: shapes do not match (tokens ", tokens.sizes(), ", u ", u.sizes(),
              ", vocabulary ", N, " ids with ", E, " extra rows)");
  const int64_t last_pos = start + T + S - 2;  // the last entry the round writes
  TORCH_CHECK(start >= 0 && last_pos < cos.size(0) && last_pos / block_size < table.size(0),
              "infer::draft_lm_round: positions up to ", last_pos, " outside the rotary tables or the block table");
  const auto tab = table.expect_contiguous(), tok = tokens.expect_contiguous(), idc = vocab_ids.expect_contiguous(),
             emc = embed.expect_contiguous(), uc = u.expect_contiguous(), cc = cos.expect_contiguous(),
             scn = sin.expect_contiguous();
  thread_local Scratch sc;
  const int64_t* tp = tab->data_ptr<int64_t>();
  draft_round::storage_rows(tp, block_size, last_pos, k_caches[0].size(0), sc.rows, "infer::draft_lm_round");
  const int64_t* rp = sc.rows.data();
  const float temp = draft_round::temperature_of(temperature);
  const bool sampled = temp > 0;
  const float t = sampled ? temp : 1.0f;
  const double* up = uc->data_ptr<double>();
  const int64_t* ids = idc->data_ptr<int64_t>();
  const BF* emb = emc->data_ptr<BF>();
  const BF* cp = cc->data_ptr<BF>();
  const BF* snp = scn->data_ptr<BF>();
  const BF* extra = E ? extra_weight->data_ptr<BF>() : nullptr;
  const int64_t V = embed.size(0);
  auto drafts = empty({1, S}, tokens.options());
  auto q = empty({1, S, N}, embed.options().dtype(at::kFloat));
  int64_t* dp = drafts.data_ptr<int64_t>();
  auto linear = [&](int64_t i, const BF* x, int64_t rows, int64_t K, BF* y) {
    infer_kernels::qlinear_into(x, rows, K, packed[i], formats[i], outs[i], y, false);
  };
  sc.x.resize(T * H);
  sc.normed.resize(T * H);
  sc.qkv.resize(T * qkv_w);
  sc.qk.resize(T * qk_w);
  sc.o.resize(T * q_size);
  sc.a.resize(T * H);
  sc.gu.resize(T * 2 * I);
  sc.act.resize(T * I);
  sc.extra.resize(E);
  sc.logits.resize(N);

  const int64_t* tk = tok->data_ptr<int64_t>();
  int64_t pos0 = start;  // the step's first entry's position
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = s == 0 ? T : 1;
    BF* x = sc.x.data();  // [n, H] the entries' residual stream
    for (int64_t i = 0; i < n; ++i) {
      const int64_t token = s == 0 ? tk[i] : dp[s - 1];
      TORCH_CHECK(token >= 0 && token < V, "infer::draft_lm_round: token id outside the embedding");
      std::memcpy(x + i * H, emb + token * H, H * sizeof(BF));
    }
    for (int64_t l = 0; l < layers; ++l) {
      BF* kc = k_caches[l].data_ptr<BF>();
      BF* vc = v_caches[l].data_ptr<BF>();
      infer_kernels::rms_norm_into(x, norms[2 * l].data_ptr<BF>(), sc.normed.data(), n, H, H, eps);
      linear(4 * l, sc.normed.data(), n, H, sc.qkv.data());  // [n, q + 2 kv]
      infer_kernels::rope_into(sc.qkv.data(), qkv_w, cp + pos0 * D, snp + pos0 * D, sc.qk.data(), n,
                               heads + kv_heads, D);  // [n, (heads + kv_heads) D]
      for (int64_t i = 0; i < n; ++i) {  // the entries' keys and values to their storage rows
        const int64_t r = rp[pos0 + i];
        std::memcpy(kc + r * kv_size, sc.qk.data() + i * qk_w + q_size, kv_size * sizeof(BF));
        std::memcpy(vc + r * kv_size, sc.qkv.data() + i * qkv_w + q_size + kv_size, kv_size * sizeof(BF));
      }
      // entry i sees every key up to its own (the causal mask of a catch-up: its keys are contiguous from 0)
      for (int64_t i = 0; i < n; ++i)
        infer_kernels::attention_paged_row(sc.qk.data() + i * qk_w, heads, D, kc, vc, kv_heads, rp, pos0 + i + 1,
                                           sc.o.data() + i * q_size);
      linear(4 * l + 1, sc.o.data(), n, q_size, sc.a.data());
      add_into(x, sc.a.data(), n * H);
      infer_kernels::rms_norm_into(x, norms[2 * l + 1].data_ptr<BF>(), sc.normed.data(), n, H, H, eps);
      linear(4 * l + 2, sc.normed.data(), n, H, sc.gu.data());
      infer_kernels::silu_mul_into(sc.gu.data(), sc.act.data(), n, I);
      linear(4 * l + 3, sc.act.data(), n, I, sc.a.data());
      add_into(x, sc.a.data(), n * H);
    }
    // the last entry's final state, then its scores over the vocabulary: the quantized rows', then the added ones'
    const BF* last = x + (n - 1) * H;
    infer_kernels::rms_norm_into(last, norms[2 * layers].data_ptr<BF>(), sc.normed.data(), 1, H, H, eps);
    infer_kernels::qlinear_into(sc.normed.data(), 1, H, vocab_packed, vocab_format, base_n, sc.logits.data(), true);
    if (E) {
      infer_kernels::linear_into(sc.normed.data(), 1, H, extra, E, sc.extra.data());
      for (int64_t j = 0; j < E; ++j) sc.logits[base_n + j] = static_cast<float>(sc.extra[j]);
    }
    const int64_t col = draw(sc.logits.data(), N, t, sampled, up[s], q.data_ptr<float>() + s * N);
    dp[s] = ids[col];
    pos0 += n;
  }
  return {drafts, q};
}
