// infer::rejection_sample: the draws of a sampled speculative round's verification, row by row, with the uniforms
// drawn by the caller (each row's own torch.Generator, in the order spec_decode/verify.py documents).
//
// Why a kernel: over SmolLM2's 49,152-token vocabulary each ATen op of the torch rule is a pass over the vocabulary
// plus ~5-10 us of dispatch, and a sampled verify of 4 drafts took ~0.9 ms of them (gathers, a residual, wheres, a
// float64 cumsum): ~8% of a round, where a plain sampled step pays ~0.25 ms. Here a row is about two passes.
//
// rejection_sample(p [B, K+1, V], drafts [B, K], q [B, K, V]?, nd [B], u [B, K] float32, u_final [B] float64)
//   -> (n [B], tokens [B, K+1]): speculative sampling with exact acceptance (spec_decode/verify.py): draft k is accepted
//   while u[k] q(t_k) < p_k(t_k) (q = 1 without q: deterministic drafts), for k < nd; then the final token is drawn
//   with u_final from p_n after a full accept (the bonus), else from max(0, p_n - q_n) (without q: p_n with t_n
//   removed), or p_n where that has no mass. The draw (`draw`) is the inverse CDF in float64 of the unnormalised
//   weights, its total scaling u: the same law as sampling.inverse_cdf of the normalised residual, summed in
//   another order (blocks of 64), so a seed's draw may differ from the torch rule's where a uniform falls within
//   rounding of a boundary. A token of zero weight is never drawn. tokens: the n accepted drafts, then the final
//   token, then -1 (verify.py's output layout).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;

// A block's float64 sum, four chains interleaved (so the additions do not wait on each other), then added in a fixed
// order: the same value wherever it is asked for.
template <typename W>
double block_sum(W w, int64_t begin, int64_t end) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = begin;
  for (; i + 4 <= end; i += 4)
    for (int l = 0; l < 4; ++l) s[l] += w(i + l);
  for (int l = 0; i < end; ++i, ++l) s[l] += w(i);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// A draw from the weights w(0..V-1) (>= 0, any total) with the uniform u in [0, 1): the total is the sum of the
// blocks' sums; the block where the running sum of blocks first exceeds u x total is scanned entry by entry from the
// sum before it. A crossing found there is at an entry of positive weight (adding 0 does not cross); rounding may
// put none in that block, and the scan goes on to the next. None at all (u x total rounded up to the total): the
// last entry of positive weight.
template <typename W>
int64_t draw(W w, int64_t V, double u) {
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  std::vector<double> sums(blocks);
  double total = 0.0;
  for (int64_t j = 0; j < blocks; ++j) total += (sums[j] = block_sum(w, j * kBlock, std::min(V, (j + 1) * kBlock)));
  const double target = u * total;
  double cum = 0.0;
  for (int64_t j = 0; j < blocks; ++j) {
    if (cum + sums[j] > target) {
      double c = cum;
      for (int64_t i = j * kBlock, e = std::min(V, (j + 1) * kBlock); i < e; ++i) {
        c += w(i);
        if (c > target) return i;
      }
    }
    cum += sums[j];
  }
  for (int64_t i = V - 1; i > 0; --i)
    if (w(i) > 0.0) return i;
  return 0;
}

std::tuple<at::Tensor, at::Tensor> rejection_sample(const at::Tensor& p, const at::Tensor& drafts,
                                                    const c10::optional<at::Tensor>& q, const at::Tensor& nd,
                                                    const at::Tensor& u, const at::Tensor& u_final) {
  TORCH_CHECK(p.dim() == 3 && p.scalar_type() == at::kFloat, "infer::rejection_sample: p must be float32 "
              "[B, K+1, V], got ", p.scalar_type(), " ", p.sizes());
  const int64_t B = p.size(0), K = p.size(1) - 1, V = p.size(2);
  TORCH_CHECK(K >= 1 && V > 0, "infer::rejection_sample: p must hold K+1 >= 2 positions over a vocabulary, got ",
              p.sizes());
  TORCH_CHECK(drafts.dim() == 2 && drafts.size(0) == B && drafts.size(1) == K && drafts.scalar_type() == at::kLong,
              "infer::rejection_sample: drafts must be int64 [", B, ", ", K, "], got ", drafts.sizes());
  TORCH_CHECK(nd.dim() == 1 && nd.size(0) == B && nd.scalar_type() == at::kLong,
              "infer::rejection_sample: nd must be int64 [", B, "]");
  TORCH_CHECK(u.dim() == 2 && u.size(0) == B && u.size(1) == K &&
              (u.scalar_type() == at::kFloat || u.scalar_type() == at::kDouble),
              "infer::rejection_sample: u must be float32 or float64 [", B, ", ", K, "]");
  TORCH_CHECK(u_final.dim() == 1 && u_final.size(0) == B && u_final.scalar_type() == at::kDouble,
              "infer::rejection_sample: u_final must be float64 [", B, "]");
  const bool has_q = q.has_value() && q->defined();
  at::Tensor qc;
  if (has_q) {
    TORCH_CHECK(q->dim() == 3 && q->size(0) == B && q->size(1) == K && q->size(2) == V &&
                q->scalar_type() == at::kFloat, "infer::rejection_sample: q must be float32 [", B, ", ", K, ", ", V,
                "], got ", q->sizes());
    qc = q->contiguous();
  }
  const auto pc = p.contiguous(), dc = drafts.contiguous(), nc = nd.contiguous(), uc = u.contiguous(),
             fc = u_final.contiguous();
  auto n_out = at::empty({B}, dc.options());
  auto tokens = at::full({B, K + 1}, -1, dc.options());
  int64_t* NO = n_out.data_ptr<int64_t>();
  int64_t* TO = tokens.data_ptr<int64_t>();
  const float* P = pc.data_ptr<float>();
  const float* Q = has_q ? qc.data_ptr<float>() : nullptr;
  const int64_t* D = dc.data_ptr<int64_t>();
  const int64_t* ND = nc.data_ptr<int64_t>();
  // u q(t) < p(t) in u's precision, as torch promotes it (float32 uniforms by default; float64 under a float64
  // default dtype)
  const bool u64 = uc.scalar_type() == at::kDouble;
  const float* U = u64 ? nullptr : uc.data_ptr<float>();
  const double* U64 = u64 ? uc.data_ptr<double>() : nullptr;
  const double* UF = fc.data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nb = std::min<int64_t>(std::max<int64_t>(ND[b], 0), K);
    int64_t n = 0;
    for (; n < nb; ++n) {  // exact acceptance: u q(t) < p(t), i.e. u < p(t) / q(t) without a division
      const int64_t t = D[b * K + n];
      TORCH_CHECK(t >= 0 && t < V, "infer::rejection_sample: draft ", t, " outside the vocabulary of ", V);
      const float p_t = P[(b * (K + 1) + n) * V + t];
      const float q_t = has_q ? Q[(b * K + n) * V + t] : 1.0f;
      const bool accept = u64 ? U64[b * K + n] * static_cast<double>(q_t) < static_cast<double>(p_t)
                              : U[b * K + n] * q_t < p_t;
      if (!accept) break;
    }
    const float* pn = P + (b * (K + 1) + n) * V;
    int64_t tok;
    if (n == nb) {  // every draft accepted: the bonus, from p after the last one
      tok = draw([pn](int64_t i) { return static_cast<double>(pn[i]); }, V, UF[b]);
    } else if (has_q) {
      const float* qn = Q + (b * K + n) * V;
      auto r = [pn, qn](int64_t i) {  // max(0, p - q) in float32, as the torch rule computes it
        const float d = pn[i] - qn[i];
        return static_cast<double>(d > 0.0f ? d : 0.0f);
      };
      bool mass = false;
      for (int64_t i = 0; i < V && !mass; ++i) mass = pn[i] - qn[i] > 0.0f;
      tok = mass ? draw(r, V, UF[b]) : draw([pn](int64_t i) { return static_cast<double>(pn[i]); }, V, UF[b]);
    } else {
      const int64_t t = D[b * K + n];
      auto r = [pn, t](int64_t i) { return i == t ? 0.0 : static_cast<double>(pn[i]); };
      bool mass = false;
      for (int64_t i = 0; i < V && !mass; ++i) mass = i != t && pn[i] > 0.0f;
      tok = mass ? draw(r, V, UF[b]) : draw([pn](int64_t i) { return static_cast<double>(pn[i]); }, V, UF[b]);
    }
    NO[b] = n;
    for (int64_t k = 0; k < n; ++k) TO[b * (K + 1) + k] = D[b * K + k];
    TO[b * (K + 1) + n] = tok;
  }
  return {n_out, tokens};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer, m) {
  m.def("rejection_sample(Tensor p, Tensor drafts, Tensor? q, Tensor nd, Tensor u, Tensor u_final) -> (Tensor, "
        "Tensor)");
}

TORCH_LIBRARY_IMPL(infer, CPU, m) {
  m.impl("rejection_sample", &rejection_sample);
}
