// infer::eagle3_round: a lone row's EAGLE-3 draft round (model.draft_heads.Eagle3Head.draft_round) in one call.
//
// A round's drafting was one compiled graph: ~25 fused elementwise kernels and 16 integer products for 3 drafts,
// entered through Python, Dynamo's guards and AOT autograd's wrapper. Every round starts cold (the verify before it
// streamed ~120 MB of the target's weights through the caches), and each line of host code or data that path walks
// comes back from memory (~90 ns a line here): the round cost 1.77 ms cold against 0.99 ms warm, of which its
// products (the kernels' own time) were 0.70. This op is the same kernels in C++, entered at their pointer level
// (ops.h's *_into) over rows kept by the calling thread: a round's host work is one call's, and it makes no tensor
// but its three outputs.
//
// The same numerics as the module's ops, step by step (tests/test_draft_heads.py compares drafts, outputs, the drafts'
// laws and the cache): every product, norm, rotation, SiLU and the attention are the same kernels; a bfloat16 add
// rounds the float sum once, as ATen's; the logits are the head's product in bfloat16 read as float32
// (float_out). One thing is left out because it changes no bit a caller reads: in the catch-up step only the last
// entry's query attends and goes on through the MLP (the other entries' outputs are never read; their keys and values
// are written as before), and every kernel here gives a row the same bits whatever rows share its call.
//
// The draw: greedy takes the first maximum of the logits (torch.max's index); a sampled row draws inverse_cdf(q, u)
// with q = softmax(logits / T) (float64 cumulation, the first index whose cumulative sum exceeds u x the total).
// q is returned (a greedy round's at T = 1, as the module's) and is the law the draft was drawn from; its exp is
// Sleef's through ATen's vectors, so q may differ from torch.softmax's in the last bits, which any q allows.
//
// With a screen (screen_top > 0: Eagle3Head.screen_top), the logits the draw reads are the vocabulary head's rows in
// Q4_0 with the screen's best screen_top rows rescored by the head's own (rescore_best below): a step reads ~2.7 MB
// of rows instead of ~5 MB. Greedy, the draft is the head's own argmax wherever that row is among the screen's best;
// sampled, q is the screen's law, and any law the draft is drawn from and reported with keeps the round lossless.
//
// A round's length by the head's confidence (stop_cal, stop_below: EagleProposer, from auto K): after draft j the
// round's chance that every draft so far is accepted, prod_{i <= j} cal[bin(conf_i)] (cal: the acceptance measured
// for drafts of each confidence bin), and the round stops before the next step where that chance is below
// stop_below[j - 1] (what draft j + 1 must be worth to pay for its step and verify row), returning the drafts so far
// (S' <= S columns; the caller truncates the cache's entries past them, none written). The head is sure of a draft
// far more often where it is right (SmolLM2: drafts of confidence >= 0.9 accepted at 0.99, < 0.3 at ~0.25), so a
// confident run goes on and an unsure one stops, where a K fixed before drafting drafts the same count for both.
// Lossless at any temperature: whether step j + 1 runs depends on drafts 1 .. j alone, each of which is kept and
// judged by the law it was drawn from (a draft dropped by its own probability would not be: spec_length.cut).
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ops.h"
#include "round.h"

namespace {

namespace draft_round = infer_kernels::draft_round;
using infer_kernels::draft_round::add_into;
using infer_kernels::draft_round::BF;
using infer_kernels::draft_round::draw;

// A round's working rows, kept by the calling thread: a round makes no tensor but its three outputs (after the verify
// streamed the target's weights, each tensor made cost ~4 us of allocator and bookkeeping lines read cold: ~60 of
// them were up to ~0.2 ms of a round of 3 drafts)
struct Scratch {
  std::vector<BF> hidden, e, x, qkv, qk, o, a, normed, gu, act, m;
  std::vector<float> logits;
  std::vector<int64_t> rows;
};

// The screen (a draft step's largest product, the vocabulary head's 8,192 rows: ~5 MB of Q8_0 a step, bound by the
// bytes it reads): the rows' logits in Q4_0, about half the bytes, and the `top` largest of those rescored with the
// head's own rows. Any logits give a lossless round (the draft is drawn from the q the call returns, and the verify
// judges it by that q); the rescoring keeps what the head's own would draft: a greedy draft is the head's own argmax
// wherever that row is among the screen's best `top`, and the leading rows of a sampled law are the head's.
constexpr int64_t kScreenFormat = 2;  // GGML's Q4_0
constexpr int64_t kScreenMax = 64;

// l [N] (the screen's logits) -> its `top` largest rows rescored by `packed` (the head), in place
inline void rescore_best(const BF* x, int64_t K, const at::Tensor& packed, int64_t format, int64_t N, int64_t top,
                         float* l) {
  int64_t best[kScreenMax];  // row ids, by logit ascending: best[0] the smallest kept
  float val[kScreenMax];
  int64_t n = 0;
  for (int64_t i = 0; i < N; ++i) {
    const float v = l[i];
    int64_t p;
    if (n < top) {  // filling: insertion from the top
      for (p = n++; p > 0 && val[p - 1] > v; --p) {
        val[p] = val[p - 1];
        best[p] = best[p - 1];
      }
    } else {
      if (!(v > val[0])) continue;  // most rows: one compare
      for (p = 0; p + 1 < top && val[p + 1] < v; ++p) {  // the smallest leaves; the smaller ones shift down
        val[p] = val[p + 1];
        best[p] = best[p + 1];
      }
    }
    val[p] = v;
    best[p] = i;
  }
  int64_t groups[kScreenMax];  // the groups of 8 rows holding them, each once
  int64_t ng = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = best[i] / 8;
    if (std::find(groups, groups + ng, g) == groups + ng) groups[ng++] = g;
  }
  thread_local std::vector<float> exact;
  exact.resize(ng * 8);
  infer_kernels::qlinear_groups_into(x, K, packed, format, N, groups, ng, exact.data());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = std::find(groups, groups + ng, best[i] / 8) - groups;
    l[best[i]] = exact[g * 8 + best[i] % 8];
  }
}

}  // namespace

// tokens [T] int64 (the catch-up entries' tokens), features [T, W] (the target's captured layers, fused by fc; W = H:
// already a hidden) at positions start .. start + T - 1, then S - 1 draft steps, each feeding the draft before and the
// last output -> (drafts [1, S] token ids, the last output [1, H], q [1, S, N], conf [1, S]: each draft's q, a greedy
// one's the largest, what auto K's cut reads without a pass over q). The draft pool's storage k, v
// [R, Hkv, D] is addressed through the row's block table: position p at table[p / bs] * bs + p % bs (the pool has
// taken the blocks and advanced the row's length: PagedKVCachePool.extend).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> infer_kernels::eagle3_round(
    const at::Tensor& tokens, const at::Tensor& features, at::TensorList packed, at::IntArrayRef formats,
    at::IntArrayRef outs, at::TensorList norms, double eps, const at::Tensor& embed, const at::Tensor& draft_ids,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& table, int64_t block_size, int64_t start, int64_t heads, int64_t kv_heads, int64_t head_dim,
    const at::Tensor& temperature, const at::Tensor& u, const std::optional<at::Tensor>& screen,
    int64_t screen_top, const std::optional<at::Tensor>& stop_cal,
    const std::optional<at::Tensor>& stop_below) {
  TORCH_CHECK(packed.size() == 6 && formats.size() == 6 && outs.size() == 6 && norms.size() == 4,
              "infer::eagle3_round: 6 products (fc, qkv, o, gate_up, down, lm_head) and 4 norms expected");
  auto bf16 = [](const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kBFloat16; };
  TORCH_CHECK(bf16(features) && bf16(embed) && bf16(k_cache) && bf16(v_cache) && bf16(cos) && bf16(sin) &&
              bf16(norms[0]) && bf16(norms[1]) && bf16(norms[2]) && bf16(norms[3]),
              "infer::eagle3_round: bfloat16 activations, embedding, norms, tables and cache expected");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && draft_ids.scalar_type() == at::kLong &&
              table.scalar_type() == at::kLong, "infer::eagle3_round: int64 tokens, draft ids and table expected");
  const int64_t T = tokens.size(0), S = u.size(1), H = embed.size(1), D = head_dim;
  const int64_t q_size = heads * D, kv_size = kv_heads * D, N = outs[5], W = features.size(1);
  const int64_t I = outs[3] / 2;  // the MLP's width (gate | up)
  TORCH_CHECK(tokens.dim() == 1 && T >= 1 && features.dim() == 2 && features.size(0) == T && S >= 1 &&
              u.dim() == 2 && u.size(0) == 1 && u.scalar_type() == at::kDouble && u.is_contiguous() &&
              temperature.numel() == 1 && draft_ids.numel() == N && outs[1] == q_size + 2 * kv_size &&
              outs[0] == H && outs[2] == H && outs[4] == H && outs[3] % 2 == 0 && embed.dim() == 2 &&
              cos.dim() == 2 && cos.size(1) == D && cos.sizes() == sin.sizes() && norms[0].numel() == H &&
              norms[1].numel() == H && norms[2].numel() == H && norms[3].numel() == H,
              "infer::eagle3_round: shapes do not match (tokens ", tokens.sizes(), ", features ", features.sizes(),
              ", u ", u.sizes(), ")");
  const int64_t last_pos = start + T + S - 2;  // the last entry the round writes
  TORCH_CHECK(start >= 0 && last_pos < cos.size(0) && last_pos / block_size < table.size(0) &&
              k_cache.dim() == 3 && k_cache.size(1) == kv_heads && k_cache.size(2) == D &&
              k_cache.sizes() == v_cache.sizes(),
              "infer::eagle3_round: positions up to ", last_pos, " outside the rotary tables, the block table or "
              "the cache's layout");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "infer::eagle3_round: the cache is written in "
              "place and must be contiguous");
  // borrowed where contiguous (every caller's case), a copy held for the call else
  const auto tab = table.expect_contiguous(), tok = tokens.expect_contiguous(), feat = features.expect_contiguous(),
             idc = draft_ids.expect_contiguous(), emc = embed.expect_contiguous(), uc = u.expect_contiguous(),
             cc = cos.expect_contiguous(), scn = sin.expect_contiguous(), n0 = norms[0].expect_contiguous(),
             n1 = norms[1].expect_contiguous(), n2 = norms[2].expect_contiguous(), n3 = norms[3].expect_contiguous();
  // the screen: the vocabulary head's rows in Q4_0 (quant.py's packing), its best screen_top rescored by the head
  const bool screened = screen.has_value() && screen->defined() && screen->numel() > 0 && screen_top > 0;
  if (screened)
    TORCH_CHECK(screen_top <= N && screen_top <= kScreenMax && formats[5] != kScreenFormat,
                "infer::eagle3_round: a screen rescores 1 .. min(", kScreenMax, ", N) rows of a head in another "
                "format than its own, got ", screen_top, " of ", N);
  // the stop: the acceptance of drafts by confidence bin (bins of equal width over [0, 1]) and a bound a step
  const bool stops = stop_cal.has_value() && stop_cal->defined() && stop_below.has_value() && stop_below->defined();
  at::Tensor cal, below;
  if (stops) {
    cal = stop_cal->to(at::kFloat).contiguous();
    below = stop_below->to(at::kFloat).contiguous();
    TORCH_CHECK(cal.dim() == 1 && cal.numel() >= 1 && cal.device().is_cpu() && below.dim() == 1 &&
                below.numel() >= S - 1 && below.device().is_cpu(),
                "infer::eagle3_round: stop_cal (acceptance by confidence bin) and stop_below (a bound for each of the "
                "S - 1 = ", S - 1, " later steps) must be 1-d CPU tensors, got ", stop_cal->sizes(), " and ",
                stop_below->sizes());
  }
  const int64_t bins = stops ? cal.numel() : 0;
  const float* calp = stops ? cal.data_ptr<float>() : nullptr;
  const float* belowp = stops ? below.data_ptr<float>() : nullptr;
  thread_local Scratch sc;
  const int64_t* tp = tab->data_ptr<int64_t>();
  draft_round::storage_rows(tp, block_size, last_pos, k_cache.size(0), sc.rows, "infer::eagle3_round");
  const int64_t* rp = sc.rows.data();

  const float temp = draft_round::temperature_of(temperature);
  const bool sampled = temp > 0;
  const float t = sampled ? temp : 1.0f;
  const double* up = uc->data_ptr<double>();
  const int64_t* ids = idc->data_ptr<int64_t>();
  const BF* emb = emc->data_ptr<BF>();
  const BF* cp = cc->data_ptr<BF>();
  const BF* snp = scn->data_ptr<BF>();
  BF* kc = k_cache.data_ptr<BF>();
  BF* vc = v_cache.data_ptr<BF>();
  const BF* nw[4] = {n0->data_ptr<BF>(), n1->data_ptr<BF>(), n2->data_ptr<BF>(), n3->data_ptr<BF>()};
  const int64_t V = embed.size(0);
  auto drafts = empty({1, S}, tokens.options());
  auto last = empty({1, H}, features.options());  // the last output; the residual stream h of each step meanwhile
  auto q = empty({1, S, N}, features.options().dtype(at::kFloat));
  auto conf = empty({1, S}, features.options().dtype(at::kFloat));  // each draft's probability under its q
  float* cp_out = conf.data_ptr<float>();
  int64_t* dp = drafts.data_ptr<int64_t>();
  BF* h = last.data_ptr<BF>();
  auto linear = [&](int i, const BF* x, int64_t rows, int64_t K, void* y, bool float_out = false) {
    infer_kernels::qlinear_into(x, rows, K, packed[i], formats[i], outs[i], y, float_out);
  };
  sc.e.resize(T * H);
  sc.x.resize(T * 2 * H);
  sc.qkv.resize(T * outs[1]);
  sc.qk.resize(T * (q_size + kv_size));
  sc.o.resize(q_size);
  sc.a.resize(H);
  sc.normed.resize(H);
  sc.gu.resize(2 * I);
  sc.act.resize(I);
  sc.m.resize(H);
  sc.logits.resize(N);

  const BF* hidden = feat->data_ptr<BF>();  // [n, H] the step's entries' hidden inputs
  if (W != H) {  // the captured layers fused by fc
    sc.hidden.resize(T * H);
    linear(0, hidden, T, W, sc.hidden.data());
    hidden = sc.hidden.data();
  }
  const int64_t* tk = tok->data_ptr<int64_t>();
  int64_t pos0 = start;  // the step's first entry's position
  double chance = 1.0;  // that every draft so far is accepted (stops)
  int64_t drawn = S;  // drafts drawn: S unless the round stops early
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = s == 0 ? T : 1;
    for (int64_t i = 0; i < n; ++i) {  // the entries' token embeddings
      const int64_t token = s == 0 ? tk[i] : dp[s - 1];
      TORCH_CHECK(token >= 0 && token < V, "infer::eagle3_round: token id outside the embedding");
      std::memcpy(sc.e.data() + i * H, emb + token * H, H * sizeof(BF));
    }
    // attention's input [norm(embedding); norm(hidden)] -> q, k, v for every entry
    infer_kernels::rms_norm_into(sc.e.data(), nw[0], sc.x.data(), n, H, 2 * H, eps);
    infer_kernels::rms_norm_into(hidden, nw[1], sc.x.data() + H, n, H, 2 * H, eps);
    linear(1, sc.x.data(), n, 2 * H, sc.qkv.data());  // [n, q + 2 kv]
    const int64_t qk_w = q_size + kv_size;
    infer_kernels::rope_into(sc.qkv.data(), outs[1], cp + pos0 * D, snp + pos0 * D, sc.qk.data(), n,
                             heads + kv_heads, D);  // [n, (heads + kv_heads) D]
    for (int64_t i = 0; i < n; ++i) {  // the entries' keys and values to their storage rows
      const int64_t r = rp[pos0 + i];
      std::memcpy(kc + r * kv_size, sc.qk.data() + i * qk_w + q_size, kv_size * sizeof(BF));
      std::memcpy(vc + r * kv_size, sc.qkv.data() + i * outs[1] + q_size + kv_size, kv_size * sizeof(BF));
    }
    // the last entry's query over every key so far (it sees them all: no mask)
    infer_kernels::attention_paged_row(sc.qk.data() + (n - 1) * qk_w, heads, D, kc, vc, kv_heads, rp, pos0 + n,
                                       sc.o.data());
    if (h != hidden + (n - 1) * H) std::memcpy(h, hidden + (n - 1) * H, H * sizeof(BF));  // the last entry's stream
    linear(2, sc.o.data(), 1, q_size, sc.a.data());
    add_into(h, sc.a.data(), H);
    infer_kernels::rms_norm_into(h, nw[2], sc.normed.data(), 1, H, H, eps);
    linear(3, sc.normed.data(), 1, H, sc.gu.data());
    infer_kernels::silu_mul_into(sc.gu.data(), sc.act.data(), 1, I);
    linear(4, sc.act.data(), 1, I, sc.m.data());
    add_into(h, sc.m.data(), H);
    // the draw over the draft vocabulary
    infer_kernels::rms_norm_into(h, nw[3], sc.normed.data(), 1, H, H, eps);
    if (screened) {  // [N]: the screen's logits, its best screen_top rows the head's own
      infer_kernels::qlinear_into(sc.normed.data(), 1, H, *screen, kScreenFormat, N, sc.logits.data(), true);
      rescore_best(sc.normed.data(), H, packed[5], formats[5], N, screen_top, sc.logits.data());
    } else {
      linear(5, sc.normed.data(), 1, H, sc.logits.data(), true);  // [N] float32 holding bfloat16 values
    }
    const int64_t col = draw(sc.logits.data(), N, t, sampled, up[s], q.data_ptr<float>() + s * N);
    dp[s] = ids[col];
    cp_out[s] = q.data_ptr<float>()[s * N + col];
    hidden = h;
    pos0 += n;
    if (stops && s + 1 < S) {
      const auto bin = std::min<int64_t>(bins - 1, std::max<int64_t>(0, static_cast<int64_t>(cp_out[s] * bins)));
      chance *= calp[bin];
      if (chance < belowp[s]) {
        drawn = s + 1;
        break;
      }
    }
  }
  if (drawn < S)
    return {drafts.narrow(1, 0, drawn), last, q.narrow(1, 0, drawn), conf.narrow(1, 0, drawn)};
  return {drafts, last, q, conf};
}
