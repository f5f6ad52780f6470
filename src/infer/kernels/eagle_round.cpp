// infer::eagle3_round: a lone row's EAGLE-3 draft round (model.draft_heads.Eagle3Head.draft_round) in one call.
//
// A round's drafting was one compiled graph: ~25 fused elementwise kernels and 16 integer products for 3 drafts,
// entered through Python, Dynamo's guards and AOT autograd's wrapper. Every round starts cold (the verify before it
// streamed ~120 MB of the target's weights through the caches), and each line of host code or data that path walks
// comes back from memory (~90 ns a line here): the round cost 1.77 ms cold against 0.99 ms warm, of which its
// products (the kernels' own time) were 0.70. This op is the same ops in C++, called as C++ functions (ops.h), so a
// round's host work is one call's.
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
#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ops.h"

namespace {

using BF = at::BFloat16;

// a[i] = bf16(float(a[i]) + float(b[i])): ATen's bfloat16 add
void add_into(BF* a, const BF* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = BF(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

// The draw over logits l [N] (float32): q [N] = softmax(l / t) (t = 1 for greedy); -> the column drawn
int64_t draw(const float* l, int64_t N, float t, bool sampled, double u, float* q) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t V = Vec::size();
  // logits / T: a division, as the module's (l / where(sampled, T, 1))
  thread_local std::vector<float> x;
  x.resize(N);
  int64_t best = 0;
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < N; ++i) {
    x[i] = l[i] / t;
    if (l[i] > l[best]) best = i;  // the first maximum of the logits (greedy's draft)
    mx = std::max(mx, x[i]);
  }
  int64_t i = 0;
  float sum = 0.0f;
  for (; i + V <= N; i += V) (Vec::loadu(x.data() + i) - Vec(mx)).exp().store(q + i);
  for (; i < N; ++i) q[i] = std::exp(x[i] - mx);
  for (i = 0; i < N; ++i) sum += q[i];
  const float inv = 1.0f / sum;
  for (i = 0; i < N; ++i) q[i] *= inv;
  if (!sampled) return best;
  double total = 0.0;
  for (i = 0; i < N; ++i) total += static_cast<double>(q[i]);
  const double target = u * total;
  double c = 0.0;
  for (i = 0; i < N; ++i) {
    c += static_cast<double>(q[i]);
    if (c > target) return i;
  }
  return N - 1;
}

struct Head {
  std::vector<at::Tensor> packed;  // fc, qkv, o, gate_up, down, lm_head
  std::vector<int64_t> formats, outs;
  std::vector<at::Tensor> norms;  // input_layernorm (embedding), hidden_norm, post_attention_layernorm, final norm
  double eps;
  at::Tensor linear(int i, const at::Tensor& x, bool float_out = false) const {
    return infer_kernels::qlinear(x, packed[i], formats[i], outs[i], c10::nullopt, float_out);
  }
  at::Tensor norm(int i, const at::Tensor& x) const { return infer_kernels::rms_norm(x, norms[i], eps, c10::nullopt); }
};

// tokens [T] int64 (the catch-up entries' tokens), features [T, W] (the target's captured layers, fused by fc; W = H:
// already a hidden) at positions start .. start + T - 1, then S - 1 draft steps, each feeding the draft before and the
// last output -> (drafts [1, S] token ids, the last output [1, H], q [1, S, N]). The draft pool's storage k, v
// [R, Hkv, D] is addressed through the row's block table: position p at table[p / bs] * bs + p % bs (the pool has
// taken the blocks and advanced the row's length: PagedKVCachePool.extend).
std::tuple<at::Tensor, at::Tensor, at::Tensor> eagle3_round(
    const at::Tensor& tokens, const at::Tensor& features, at::TensorList packed, at::IntArrayRef formats,
    at::IntArrayRef outs, at::TensorList norms, double eps, const at::Tensor& embed, const at::Tensor& draft_ids,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& table, int64_t block_size, int64_t start, int64_t heads, int64_t kv_heads, int64_t head_dim,
    const at::Tensor& temperature, const at::Tensor& u) {
  TORCH_CHECK(packed.size() == 6 && formats.size() == 6 && outs.size() == 6 && norms.size() == 4,
              "infer::eagle3_round: 6 products (fc, qkv, o, gate_up, down, lm_head) and 4 norms expected");
  TORCH_CHECK(features.scalar_type() == at::kBFloat16 && embed.scalar_type() == at::kBFloat16 &&
              k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
              cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
              "infer::eagle3_round: bfloat16 activations, embedding, tables and cache expected");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && draft_ids.scalar_type() == at::kLong,
              "infer::eagle3_round: int64 tokens and draft ids expected");
  const int64_t T = tokens.size(0), S = u.size(1), H = embed.size(1), D = head_dim;
  const int64_t q_size = heads * D, kv_size = kv_heads * D, N = outs[5];
  TORCH_CHECK(tokens.dim() == 1 && T >= 1 && features.dim() == 2 && features.size(0) == T && S >= 1 &&
              u.dim() == 2 && u.size(0) == 1 && u.scalar_type() == at::kDouble && temperature.numel() == 1 &&
              draft_ids.numel() == N && outs[1] == q_size + 2 * kv_size,
              "infer::eagle3_round: shapes do not match (tokens ", tokens.sizes(), ", features ", features.sizes(),
              ", u ", u.sizes(), ")");
  const int64_t last_pos = start + T + S - 2;  // the last entry the round writes
  TORCH_CHECK(start >= 0 && last_pos < cos.size(0) && last_pos / block_size < table.size(0) &&
              k_cache.dim() == 3 && k_cache.size(1) == kv_heads && k_cache.size(2) == D &&
              k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "infer::eagle3_round: positions up to ", last_pos, " outside the rotary tables, the block table or "
              "the cache's layout");
  const Head hd{packed.vec(), formats.vec(), outs.vec(), norms.vec(), eps};
  const auto tab = table.contiguous();
  const int64_t* tp = tab.data_ptr<int64_t>();
  auto row_of = [&](int64_t p) { return tp[p / block_size] * block_size + p % block_size; };
  auto rows = at::empty({1, last_pos + 1}, tab.options());  // storage rows of positions 0 .. last_pos
  int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t p = 0; p <= last_pos; ++p) {
    rp[p] = row_of(p);
    TORCH_CHECK(rp[p] >= 0 && rp[p] < k_cache.size(0), "infer::eagle3_round: block table outside the cache");
  }

  const float temp = temperature.item<float>();
  const bool sampled = temp > 0;
  const float t = sampled ? temp : 1.0f;
  // held for the call: the pointers below read them
  const auto uc = u.contiguous(), idc = draft_ids.contiguous(), embc = embed.contiguous();
  const double* up = uc.data_ptr<double>();
  const int64_t* ids = idc.data_ptr<int64_t>();
  const BF* emb = embc.data_ptr<BF>();
  const int64_t V = embed.size(0);
  auto drafts = at::empty({1, S}, tokens.options());
  auto q = at::empty({1, S, N}, features.options().dtype(at::kFloat));
  int64_t* dp = drafts.data_ptr<int64_t>();

  at::Tensor hidden = features.size(1) == H ? features.contiguous() : hd.linear(0, features);  // [T, H]
  at::Tensor tok = tokens.contiguous();
  const int64_t* tk = tok.data_ptr<int64_t>();
  std::vector<int64_t> step_tokens(tk, tk + T);
  int64_t pos0 = start;  // the step's first entry's position
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = s == 0 ? T : 1;
    auto e = at::empty({n, H}, hidden.options());  // the entries' token embeddings
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(step_tokens[i] >= 0 && step_tokens[i] < V, "infer::eagle3_round: token id outside the embedding");
      std::memcpy(e.data_ptr<BF>() + i * H, emb + step_tokens[i] * H, H * sizeof(BF));
    }
    // attention's input [norm(embedding); norm(hidden)] -> q, k, v for every entry
    auto x = at::cat({hd.norm(0, e), hd.norm(1, hidden)}, 1);
    auto qkv = hd.linear(1, x);  // [n, q + 2 kv]
    auto qk = infer_kernels::rope(qkv, cos.narrow(0, pos0, n), sin.narrow(0, pos0, n), heads + kv_heads, D,
                                  c10::nullopt);  // [n, (heads + kv_heads) D]
    const BF* qkp = qk.data_ptr<BF>();
    const BF* vp = qkv.data_ptr<BF>() + q_size + kv_size;
    for (int64_t i = 0; i < n; ++i) {  // the entries' keys and values to their storage rows
      const int64_t r = rp[pos0 + i];
      std::memcpy(k_cache.data_ptr<BF>() + r * kv_size, qkp + i * (q_size + kv_size) + q_size, kv_size * sizeof(BF));
      std::memcpy(v_cache.data_ptr<BF>() + r * kv_size, vp + i * outs[1], kv_size * sizeof(BF));
    }
    // the last entry's query over every key so far (it sees them all: no mask)
    const int64_t kv_len = pos0 + n;
    auto qv = qk.narrow(0, n - 1, 1).view({1, 1, heads + kv_heads, D}).narrow(2, 0, heads).transpose(1, 2);
    auto o = infer_kernels::attention(qv, k_cache, v_cache, c10::nullopt, rows.narrow(1, 0, kv_len), c10::nullopt);
    auto h = hidden.narrow(0, n - 1, 1).clone();  // [1, H] the residual stream of the last entry
    auto a = hd.linear(2, o.transpose(1, 2).reshape({1, q_size}));
    add_into(h.data_ptr<BF>(), a.data_ptr<BF>(), H);
    auto m = hd.linear(4, infer_kernels::silu_mul(hd.linear(3, hd.norm(2, h)), c10::nullopt));
    add_into(h.data_ptr<BF>(), m.data_ptr<BF>(), H);
    // the draw over the draft vocabulary
    auto logits = hd.linear(5, hd.norm(3, h), true);  // [1, N] float32 holding bfloat16 values
    const int64_t col = draw(logits.data_ptr<float>(), N, t, sampled, up[s], q.data_ptr<float>() + s * N);
    dp[s] = ids[col];
    step_tokens.assign(1, dp[s]);
    hidden = h;
    pos0 += n;
  }
  return {drafts, hidden, q};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer, m) {
  m.def("eagle3_round(Tensor tokens, Tensor features, Tensor[] packed, int[] formats, int[] outs, Tensor[] norms, "
        "float eps, Tensor embed, Tensor draft_ids, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor table, int block_size, int start, int heads, int kv_heads, int head_dim, Tensor temperature, "
        "Tensor u) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(infer, CPU, m) {
  m.impl("eagle3_round", &eagle3_round);
}
