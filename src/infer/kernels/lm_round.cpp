// A Llama stack in one call, two ops over the same layer walk (`layer` below):
//   infer::draft_lm_round: a lone row's round of a draft LM (proposers.draft_model.DraftModelProposer);
//   infer::llama_forward: a lone row's forward of any block-quantized bfloat16 Llama over a paged pool
//     (LlamaForCausalLM.forward: the target's decode, verify and K = 0 steps, model.llama says when).
//
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
// llama_forward exists for the target's few-token steps: a decode step of SmolLM2 through its compiled graph spent
// ~2.3 of its ~10 ms (Intel Xeon, 2026-12-03) outside the kernels, in the graph's entry, the dispatcher's ~12 calls a
// layer and the graph's own pointwise code; the same kernels chained here over pointers leave only their work. It
// returns what the module's forward returns: the final norm of every entry, then the outputs of the layers asked for
// (an EAGLE-3 drafter's features), [1, T, (1 + n) H]. A target carrying a LoRA adapter (model.lora) passes each
// product's A and B: its delta is added as the module adds it.
#include <cstring>
#include <vector>

#include "ops.h"
#include "round.h"

namespace {

namespace draft_round = infer_kernels::draft_round;
using infer_kernels::draft_round::add_into;
using infer_kernels::draft_round::BF;
using infer_kernels::draft_round::draw;

// the calling thread's working rows (no allocation after its first call)
struct Scratch {
  std::vector<BF> x, normed, qkv, qk, o, a, gu, act, extra, lora_t, lora_u;
  std::vector<float> logits;
  std::vector<int64_t> rows;
};

// A Llama stack's weights, caches and shapes, checked once a call (`stack`)
struct Stack {
  at::TensorList packed, norms, k_caches, v_caches, lora;
  at::IntArrayRef formats, outs;
  double eps;
  const BF* cos;
  const BF* sin;
  int64_t layers, H, heads, kv_heads, D, I, q_size, kv_size, qkv_w, qk_w;
};

// packed, formats, outs: 4 products a layer (qkv, o, gate_up, down); norms: 2 a layer (input, post-attention) and the
// final one; k_caches, v_caches: each layer's paged storage [R, Hkv, D] (written in place)
Stack stack(const char* op, at::TensorList packed, at::IntArrayRef formats, at::IntArrayRef outs, at::TensorList norms,
            double eps, const at::Tensor& embed, const at::Tensor& cos, const at::Tensor& sin,
            at::TensorList k_caches, at::TensorList v_caches, int64_t heads, int64_t kv_heads, int64_t head_dim,
            at::TensorList lora = {}) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(v_caches.size()) == layers &&
              static_cast<int64_t>(packed.size()) == 4 * layers && static_cast<int64_t>(formats.size()) == 4 * layers &&
              static_cast<int64_t>(outs.size()) == 4 * layers && static_cast<int64_t>(norms.size()) == 2 * layers + 1,
              op, ": per layer a cache, 4 products (qkv, o, gate_up, down) and 2 norms, and a final norm expected");
  auto bf16 = [](const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kBFloat16; };
  bool caches_ok = true;
  for (int64_t l = 0; l < layers; ++l)
    caches_ok &= bf16(k_caches[l]) && bf16(v_caches[l]) && k_caches[l].is_contiguous() &&
                 v_caches[l].is_contiguous() && k_caches[l].dim() == 3 && k_caches[l].size(1) == kv_heads &&
                 k_caches[l].size(2) == head_dim && k_caches[l].sizes() == v_caches[l].sizes() &&
                 k_caches[l].size(0) == k_caches[0].size(0);
  TORCH_CHECK(caches_ok, op, ": each layer's cache contiguous bfloat16 [R, ", kv_heads, ", ", head_dim,
              "] expected (written in place)");
  TORCH_CHECK(bf16(embed) && embed.dim() == 2, op, ": a bfloat16 embedding [V, H] expected");
  const int64_t H = embed.size(1);
  bool norms_ok = true;
  for (const auto& n : norms) norms_ok &= bf16(n) && n.is_contiguous() && n.numel() == H;
  TORCH_CHECK(norms_ok && bf16(cos) && bf16(sin) && cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
              cos.size(1) == head_dim && cos.sizes() == sin.sizes(),
              op, ": bfloat16 norms [H] and contiguous rotary tables [P, ", head_dim, "] expected");
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  bool outs_ok = outs[2] % 2 == 0;
  for (int64_t l = 0; l < layers; ++l)
    outs_ok &= outs[4 * l] == q_size + 2 * kv_size && outs[4 * l + 1] == H && outs[4 * l + 2] == outs[2] &&
               outs[4 * l + 3] == H;
  TORCH_CHECK(outs_ok, op, ": each layer's products must be [", q_size + 2 * kv_size, ", ", H, ", 2 I, ", H, "]");
  // LoRA (model.lora): none, or per product an A [R, in] and a B [out, R] (both empty: no adapter on it)
  TORCH_CHECK(lora.empty() || static_cast<int64_t>(lora.size()) == 8 * layers, op,
              ": lora holds an A and a B for each of the 4 products a layer (", 8 * layers, " tensors), or nothing");
  for (int64_t p = 0; p < static_cast<int64_t>(lora.size()) / 2; ++p) {
    const at::Tensor &a = lora[2 * p], &b = lora[2 * p + 1];
    if (a.numel() == 0 && b.numel() == 0) continue;
    const int64_t in = p % 4 == 0 || p % 4 == 2 ? H : p % 4 == 1 ? q_size : outs[2] / 2;
    TORCH_CHECK(bf16(a) && bf16(b) && a.is_contiguous() && b.is_contiguous() && a.dim() == 2 && b.dim() == 2 &&
                a.size(1) == in && b.size(0) == outs[p] && b.size(1) == a.size(0) && a.size(0) >= 1,
                op, ": product ", p, "'s LoRA must be contiguous bfloat16 A [R, ", in, "] and B [", outs[p], ", R]");
  }
  return {packed, norms, k_caches, v_caches, lora, formats, outs, eps, cos.data_ptr<BF>(), sin.data_ptr<BF>(), layers,
          H, heads, kv_heads, head_dim, outs[2] / 2, q_size, kv_size, q_size + 2 * kv_size, q_size + kv_size};
}

void reserve(Scratch& sc, const Stack& s, int64_t n) {
  sc.x.resize(n * s.H);
  sc.normed.resize(n * s.H);
  sc.qkv.resize(n * s.qkv_w);
  sc.qk.resize(n * s.qk_w);
  sc.o.resize(n * s.q_size);
  sc.a.resize(n * s.H);
  sc.gu.resize(n * 2 * s.I);
  sc.act.resize(n * s.I);
}

// entries x [n, H] (the residual stream) at positions pos0 .. pos0 + n - 1 through layer l, as DecoderLayer.forward:
// their keys and values written to storage rows rp[pos], entry i attending every key up to its own position (the
// causal mask of a chain appended to its cache: keys 0 .. pos0 + i, contiguous from 0)
void layer(const Stack& s, int64_t l, BF* x, int64_t n, int64_t pos0, const int64_t* rp, Scratch& sc) {
  auto linear = [&](int64_t i, const BF* in, int64_t K, BF* y) {
    infer_kernels::qlinear_into(in, n, K, s.packed[i], s.formats[i], s.outs[i], y, false);
    if (!s.lora.empty() && s.lora[2 * i].numel()) {  // + B (A x), as LoRALinear: two infer::linear, ATen's add
      const at::Tensor &a = s.lora[2 * i], &b = s.lora[2 * i + 1];
      const int64_t R = a.size(0), N = s.outs[i];
      sc.lora_t.resize(n * R);
      sc.lora_u.resize(n * N);
      infer_kernels::linear_into(in, n, K, a.data_ptr<BF>(), R, sc.lora_t.data());
      infer_kernels::linear_into(sc.lora_t.data(), n, R, b.data_ptr<BF>(), N, sc.lora_u.data());
      add_into(y, sc.lora_u.data(), n * N);
    }
  };
  const int64_t H = s.H, D = s.D;
  BF* kc = s.k_caches[l].data_ptr<BF>();
  BF* vc = s.v_caches[l].data_ptr<BF>();
  infer_kernels::rms_norm_into(x, s.norms[2 * l].data_ptr<BF>(), sc.normed.data(), n, H, H, s.eps);
  linear(4 * l, sc.normed.data(), H, sc.qkv.data());  // [n, q + 2 kv]
  infer_kernels::rope_into(sc.qkv.data(), s.qkv_w, s.cos + pos0 * D, s.sin + pos0 * D, sc.qk.data(), n,
                           s.heads + s.kv_heads, D);  // [n, (heads + kv_heads) D]
  for (int64_t i = 0; i < n; ++i) {  // the entries' keys and values to their storage rows
    const int64_t r = rp[pos0 + i];
    std::memcpy(kc + r * s.kv_size, sc.qk.data() + i * s.qk_w + s.q_size, s.kv_size * sizeof(BF));
    std::memcpy(vc + r * s.kv_size, sc.qkv.data() + i * s.qkv_w + s.q_size + s.kv_size, s.kv_size * sizeof(BF));
  }
  infer_kernels::attention_paged_chain(sc.qk.data(), n, s.qk_w, s.heads, D, kc, vc, s.kv_heads, rp, pos0,
                                      sc.o.data());
  linear(4 * l + 1, sc.o.data(), s.q_size, sc.a.data());
  add_into(x, sc.a.data(), n * H);
  infer_kernels::rms_norm_into(x, s.norms[2 * l + 1].data_ptr<BF>(), sc.normed.data(), n, H, H, s.eps);
  linear(4 * l + 2, sc.normed.data(), H, sc.gu.data());
  infer_kernels::silu_mul_into(sc.gu.data(), sc.act.data(), n, s.I);
  linear(4 * l + 3, sc.act.data(), s.I, sc.a.data());
  add_into(x, sc.a.data(), n * H);
}

// x [n, H] = the embedding's rows of tokens (each checked against its V rows)
void embed_into(const BF* emb, int64_t V, int64_t H, const int64_t* tokens, int64_t n, BF* x, const char* op) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(tokens[i] >= 0 && tokens[i] < V, op, ": token id ", tokens[i], " outside the embedding");
    std::memcpy(x + i * H, emb + tokens[i] * H, H * sizeof(BF));
  }
}

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
  const char* op = "infer::draft_lm_round";
  const Stack st = stack(op, packed, formats, outs, norms, eps, embed, cos, sin, k_caches, v_caches, heads, kv_heads,
                         head_dim);
  const int64_t H = st.H;
  TORCH_CHECK(tokens.scalar_type() == at::kLong && vocab_ids.scalar_type() == at::kLong &&
              table.scalar_type() == at::kLong, op, ": int64 tokens, vocabulary ids and table expected");
  const int64_t T = tokens.numel(), S = u.size(1), N = vocab_ids.numel();
  const int64_t E = extra_weight.has_value() && extra_weight->defined() ? extra_weight->size(0) : 0;
  const int64_t base_n = N - E;
  auto bf16 = [](const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kBFloat16; };
  TORCH_CHECK(tokens.dim() == 1 && T >= 1 && S >= 1 && u.dim() == 2 && u.size(0) == 1 &&
              u.scalar_type() == at::kDouble && temperature.numel() == 1 && base_n >= 1 &&
              (E == 0 || (bf16(*extra_weight) && extra_weight->dim() == 2 && extra_weight->size(1) == H)),
              op, ": shapes do not match (tokens ", tokens.sizes(), ", u ", u.sizes(), ", vocabulary ", N,
              " ids with ", E, " extra rows)");
  const int64_t last_pos = start + T + S - 2;  // the last entry the round writes
  TORCH_CHECK(start >= 0 && last_pos < cos.size(0) && last_pos / block_size < table.size(0), op, ": positions up to ",
              last_pos, " outside the rotary tables or the block table");
  const auto tab = table.expect_contiguous(), tok = tokens.expect_contiguous(), idc = vocab_ids.expect_contiguous(),
             emc = embed.expect_contiguous(), uc = u.expect_contiguous();
  thread_local Scratch sc;
  draft_round::storage_rows(tab->data_ptr<int64_t>(), block_size, last_pos, k_caches[0].size(0), sc.rows, op);
  const int64_t* rp = sc.rows.data();
  const float temp = draft_round::temperature_of(temperature);
  const bool sampled = temp > 0;
  const float t = sampled ? temp : 1.0f;
  const double* up = uc->data_ptr<double>();
  const int64_t* ids = idc->data_ptr<int64_t>();
  const BF* extra = E ? extra_weight->data_ptr<BF>() : nullptr;
  auto drafts = empty({1, S}, tokens.options());
  auto q = empty({1, S, N}, embed.options().dtype(at::kFloat));
  int64_t* dp = drafts.data_ptr<int64_t>();
  reserve(sc, st, T);
  sc.extra.resize(E);
  sc.logits.resize(N);

  const int64_t* tk = tok->data_ptr<int64_t>();
  int64_t pos0 = start;  // the step's first entry's position
  for (int64_t s = 0; s < S; ++s) {
    // the catch-up entries first, then one entry a step: the draft before
    const int64_t n = s == 0 ? T : 1;
    BF* x = sc.x.data();  // [n, H] the entries' residual stream
    embed_into(emc->data_ptr<BF>(), embed.size(0), H, s == 0 ? tk : dp + s - 1, n, x, op);
    // every entry of the catch-up goes through every layer (a later layer's keys are its outputs)
    for (int64_t l = 0; l < st.layers; ++l) layer(st, l, x, n, pos0, rp, sc);
    // the last entry's final state, then its scores over the vocabulary: the quantized rows', then the added ones'
    const BF* last = x + (n - 1) * H;
    infer_kernels::rms_norm_into(last, norms[2 * st.layers].data_ptr<BF>(), sc.normed.data(), 1, H, H, eps);
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

// tokens [T] int64 at positions start .. start + T - 1 of a lone paged row (the pool has taken their blocks and
// advanced the row's length: PagedKVCachePool.prepare), each entry attending the keys up to its own position, through
// the stack -> [1, T, (1 + len(aux)) H] bfloat16: the final norm of each entry, then the outputs of layers aux (in the
// order given), as LlamaForCausalLM.forward returns them. rows: the storage row of each position 0 .. start + T - 1.
// lora: empty, or each product's LoRA A and B (both empty where it has none).
at::Tensor infer_kernels::llama_forward(const at::Tensor& tokens, at::TensorList packed, at::IntArrayRef formats,
                                        at::IntArrayRef outs, at::TensorList norms, double eps,
                                        const at::Tensor& embed, const at::Tensor& cos, const at::Tensor& sin,
                                        at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& rows,
                                        int64_t start, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                        at::IntArrayRef aux, at::TensorList lora) {
  const char* op = "infer::llama_forward";
  const Stack st = stack(op, packed, formats, outs, norms, eps, embed, cos, sin, k_caches, v_caches, heads, kv_heads,
                         head_dim, lora);
  const int64_t H = st.H, T = tokens.numel(), A = static_cast<int64_t>(aux.size()), W = (1 + A) * H;
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 1 && T >= 1 && rows.scalar_type() == at::kLong &&
              rows.dim() == 1 && start >= 0 && rows.numel() >= start + T && start + T <= cos.size(0),
              op, ": int64 tokens [T] and the storage rows of positions 0 .. start + T - 1 (", start + T,
              ") inside the rotary tables expected, got tokens ", tokens.sizes(), ", rows ", rows.sizes());
  std::vector<int64_t> at_layer(st.layers, -1);  // layer -> its column block in the output (1 + its place in aux)
  for (int64_t a = 0; a < A; ++a) {
    TORCH_CHECK(aux[a] >= 0 && aux[a] < st.layers, op, ": layer ", aux[a], " does not exist");
    at_layer[aux[a]] = 1 + a;
  }
  const auto rc = rows.expect_contiguous(), tok = tokens.expect_contiguous(), emc = embed.expect_contiguous();
  const int64_t* rp = rc->data_ptr<int64_t>();
  const int64_t R = k_caches[0].size(0);
  for (int64_t p = 0; p < start + T; ++p) TORCH_CHECK(rp[p] >= 0 && rp[p] < R, op, ": storage row outside the cache");
  thread_local Scratch sc;
  reserve(sc, st, T);
  auto out = empty({1, T, W}, embed.options());
  BF* o = out.data_ptr<BF>();
  BF* x = sc.x.data();  // [T, H] the entries' residual stream
  embed_into(emc->data_ptr<BF>(), embed.size(0), H, tok->data_ptr<int64_t>(), T, x, op);
  for (int64_t l = 0; l < st.layers; ++l) {
    layer(st, l, x, T, start, rp, sc);
    if (at_layer[l] >= 0)
      for (int64_t i = 0; i < T; ++i) std::memcpy(o + i * W + at_layer[l] * H, x + i * H, H * sizeof(BF));
  }
  // the final norm, written into the output's first H columns of each entry
  infer_kernels::rms_norm_into(x, norms[2 * st.layers].data_ptr<BF>(), o, T, H, W, eps);
  return out;
}
