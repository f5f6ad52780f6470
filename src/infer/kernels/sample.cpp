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
//
// rejection_sample_logits(logits [B, K+1, V], temperature [B], drafts, q?, nd, u, u_final, q_ids?): the same rule
//   with p the plain temperature law, p = softmax(logits / T) (sampling.logits_to_probs without its other stages),
//   computed here for the positions the rule reads: a position's max and normaliser where a draft is judged, the
//   weights of the final token's law once. The torch path computed p over all K+1 positions first (a division, a
//   max, an exp and a sum over [K+1, V]: ~0.14 ms of a SmolLM2 round at 0.7, AMD EPYC Zen 4, 2 cores), and the rule
//   then read it; a round judges 2.2 positions on average there. p differs from torch's softmax in the last bits
//   (another order of summation), as any two implementations of the law do. q is [B, K, V], or with q_ids
//   (distinct token ids [N]) [B, K, N] over those ids and 0 elsewhere: a drafter's draft vocabulary, judged
//   without a [B, K, V] built for it.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <sleef.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "ops.h"

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
// last entry of positive weight. `draw_blocks` takes the blocks' sums (block j: entries j x kBlock ..) from its caller,
// `draw` computes them (block_sum).
template <typename W>
int64_t draw_blocks(W w, const double* sums, int64_t V, double u) {
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t j = 0; j < blocks; ++j) total += sums[j];
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

template <typename W>
int64_t draw(W w, int64_t V, double u) {
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  std::vector<double> sums(blocks);
  for (int64_t j = 0; j < blocks; ++j) sums[j] = block_sum(w, j * kBlock, std::min(V, (j + 1) * kBlock));
  return draw_blocks(w, sums.data(), V, u);
}

// What both kernels share: the drafts, their counts and the uniforms, checked and read; exact acceptance; the
// outputs. `op` names the kernel in the errors.
struct Rule {
  int64_t B, K;
  at::Tensor dc, nc, uc, fc, n_out, tokens;
  const int64_t* D;
  const int64_t* ND;
  const float* U;     // float32 uniforms, or
  const double* U64;  // float64 ones (under a float64 default dtype)
  const double* UF;
  int64_t *NO, *TO;

  Rule(const char* op, const at::Tensor& drafts, const at::Tensor& nd, const at::Tensor& u, const at::Tensor& u_final,
       int64_t B_, int64_t K_, int64_t V) : B(B_), K(K_) {
    TORCH_CHECK(drafts.dim() == 2 && drafts.size(0) == B && drafts.size(1) == K &&
                drafts.scalar_type() == at::kLong, op, ": drafts must be int64 [", B, ", ", K, "], got ",
                drafts.sizes());
    TORCH_CHECK(nd.dim() == 1 && nd.size(0) == B && nd.scalar_type() == at::kLong, op, ": nd must be int64 [", B,
                "]");
    TORCH_CHECK(u.dim() == 2 && u.size(0) == B && u.size(1) == K &&
                (u.scalar_type() == at::kFloat || u.scalar_type() == at::kDouble),
                op, ": u must be float32 or float64 [", B, ", ", K, "]");
    TORCH_CHECK(u_final.dim() == 1 && u_final.size(0) == B && u_final.scalar_type() == at::kDouble,
                op, ": u_final must be float64 [", B, "]");
    dc = drafts.contiguous(), nc = nd.contiguous(), uc = u.contiguous(), fc = u_final.contiguous();
    n_out = infer_kernels::empty({B}, dc.options());
    tokens = infer_kernels::empty({B, K + 1}, dc.options());
    tokens.fill_(-1);
    D = dc.data_ptr<int64_t>(), ND = nc.data_ptr<int64_t>(), UF = fc.data_ptr<double>();
    const bool u64 = uc.scalar_type() == at::kDouble;
    U = u64 ? nullptr : uc.data_ptr<float>(), U64 = u64 ? uc.data_ptr<double>() : nullptr;
    NO = n_out.data_ptr<int64_t>(), TO = tokens.data_ptr<int64_t>();
    for (int64_t r = 0; r < B; ++r)
      for (int64_t k = 0; k < drafts_of(r); ++k)
        TORCH_CHECK(D[r * K + k] >= 0 && D[r * K + k] < V, op, ": draft ", D[r * K + k], " outside the vocabulary of ",
                    V);
  }
  // the drafts row b may have judged: nd[b], within 0..K
  int64_t drafts_of(int64_t b) const { return std::min<int64_t>(std::max<int64_t>(ND[b], 0), K); }
  int64_t draft(int64_t b, int64_t n) const { return D[b * K + n]; }
  // exact acceptance: u q(t) < p(t), i.e. u < p(t) / q(t) without a division, in u's precision (as torch promotes)
  bool accepts(int64_t b, int64_t n, float p_t, float q_t) const {
    return U64 ? U64[b * K + n] * static_cast<double>(q_t) < static_cast<double>(p_t) : U[b * K + n] * q_t < p_t;
  }
  // row b accepted its first n drafts and ends with tok
  void emit(int64_t b, int64_t n, int64_t tok) {
    NO[b] = n;
    for (int64_t k = 0; k < n; ++k) TO[b * (K + 1) + k] = D[b * K + k];
    TO[b * (K + 1) + n] = tok;
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> infer_kernels::rejection_sample(const at::Tensor& p, const at::Tensor& drafts,
                                                    const c10::optional<at::Tensor>& q, const at::Tensor& nd,
                                                    const at::Tensor& u, const at::Tensor& u_final) {
  TORCH_CHECK(p.dim() == 3 && p.scalar_type() == at::kFloat, "infer::rejection_sample: p must be float32 "
              "[B, K+1, V], got ", p.scalar_type(), " ", p.sizes());
  const int64_t B = p.size(0), K = p.size(1) - 1, V = p.size(2);
  TORCH_CHECK(K >= 1 && V > 0, "infer::rejection_sample: p must hold K+1 >= 2 positions over a vocabulary, got ",
              p.sizes());
  Rule rule("infer::rejection_sample", drafts, nd, u, u_final, B, K, V);
  const bool has_q = q.has_value() && q->defined();
  at::Tensor qc;
  if (has_q) {
    TORCH_CHECK(q->dim() == 3 && q->size(0) == B && q->size(1) == K && q->size(2) == V &&
                q->scalar_type() == at::kFloat, "infer::rejection_sample: q must be float32 [", B, ", ", K, ", ", V,
                "], got ", q->sizes());
    qc = q->contiguous();
  }
  const auto pc = p.contiguous();
  const float* P = pc.data_ptr<float>();
  const float* Q = has_q ? qc.data_ptr<float>() : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nb = rule.drafts_of(b);
    int64_t n = 0;
    for (; n < nb; ++n) {
      const int64_t t = rule.draft(b, n);
      if (!rule.accepts(b, n, P[(b * (K + 1) + n) * V + t], has_q ? Q[(b * K + n) * V + t] : 1.0f)) break;
    }
    const float* pn = P + (b * (K + 1) + n) * V;
    const double UF = rule.UF[b];
    int64_t tok;
    if (n == nb) {  // every draft accepted: the bonus, from p after the last one
      tok = draw([pn](int64_t i) { return static_cast<double>(pn[i]); }, V, UF);
    } else if (has_q) {
      const float* qn = Q + (b * K + n) * V;
      auto r = [pn, qn](int64_t i) {  // max(0, p - q) in float32, as the torch rule computes it
        const float d = pn[i] - qn[i];
        return static_cast<double>(d > 0.0f ? d : 0.0f);
      };
      bool mass = false;
      for (int64_t i = 0; i < V && !mass; ++i) mass = pn[i] - qn[i] > 0.0f;
      tok = mass ? draw(r, V, UF) : draw([pn](int64_t i) { return static_cast<double>(pn[i]); }, V, UF);
    } else {
      const int64_t t = rule.draft(b, n);
      auto r = [pn, t](int64_t i) { return i == t ? 0.0 : static_cast<double>(pn[i]); };
      bool mass = false;
      for (int64_t i = 0; i < V && !mass; ++i) mass = i != t && pn[i] > 0.0f;
      tok = mass ? draw(r, V, UF) : draw([pn](int64_t i) { return static_cast<double>(pn[i]); }, V, UF);
    }
    rule.emit(b, n, tok);
  }
  return {rule.n_out, rule.tokens};
}

namespace {

// A position's temperature law over logits row l: e_i = exp(l_i / T - m) (l times 1 / T: the law's own rounding,
// not torch's division), m the largest l_i / T (the largest l times 1 / T: rounding is monotone), z = the sum of e,
// p_i = e_i x (1 / z). The exp is Sleef's (1 ulp; its 16-lane form where the build targets AVX-512), a lane's value
// independent of its neighbours. e is written once, with its blocks' sums (`fsum`), which the final draw scans
// (`draw_blocks`): no second pass over the vocabulary for a bonus token. The vocabulary goes in chunks of whole
// blocks over the threads; z is the blocks' sums added in order: the same on any number of threads.
constexpr int64_t kChunk = 64 * kBlock;

using Vec = at::vec::Vectorized<float>;

inline float exp1(float x) {
  float lanes[Vec::size()];
  Vec(x).exp().store(lanes);
  return lanes[0];
}

// a block's float sum: Vec::size() lanes (lane k: entries k, k + lanes, ..), then the lanes in order, then the tail
inline double fsum(const float* w, int64_t n) {
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = acc + Vec::loadu(w + i);
  float lanes[Vec::size()];
  acc.store(lanes);
  float s = 0.0f;
  for (int k = 0; k < Vec::size(); ++k) s += lanes[k];
  for (; i < n; ++i) s += w[i];
  return s;
}

// e[0..n) = exp(l * inv_t - m) (a tail past the last 16 lanes through the 8-lane exp: none over SmolLM2's 49,152)
inline void exp_run(const float* l, float inv_t, float m, float* e, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 tv = _mm512_set1_ps(inv_t), mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(e + i, Sleef_expf16_u10(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(l + i), tv), mv)));
#else
  const Vec tv(inv_t), mv(m);
  for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(l + i) * tv - mv).exp().store(e + i);
#endif
  for (; i < n; ++i) e[i] = exp1(l[i] * inv_t - m);
}

struct Law {
  const float* e;
  const double* sums;  // [V / kBlock] the blocks' sums of e
  float iz;            // 1 / z
  inline float operator()(int64_t i) const { return e[i] * iz; }
};

inline Law law(const float* l, float inv_t, int64_t V, float* e, double* sums, bool threads) {
  const int64_t chunks = (V + kChunk - 1) / kChunk;
  std::vector<float> mx(chunks);
  auto each = [&](auto&& fn) {
    if (threads) {
      at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) { for (int64_t c = c0; c < c1; ++c) fn(c); });
    } else {
      for (int64_t c = 0; c < chunks; ++c) fn(c);
    }
  };
  each([&](int64_t c) {
    const int64_t i0 = c * kChunk, i1 = std::min(V, i0 + kChunk);
    Vec v(-std::numeric_limits<float>::infinity());
    int64_t i = i0;
    for (; i + Vec::size() <= i1; i += Vec::size()) v = at::vec::maximum(v, Vec::loadu(l + i));
    float lanes[Vec::size()];
    v.store(lanes);
    float m = *std::max_element(lanes, lanes + Vec::size());
    for (; i < i1; ++i) m = std::max(m, l[i]);
    mx[c] = m;
  });
  const float m = *std::max_element(mx.begin(), mx.end()) * inv_t;
  each([&](int64_t c) {
    for (int64_t i = c * kChunk, i1 = std::min(V, i + kChunk); i < i1; i += kBlock) {
      const int64_t n = std::min(kBlock, i1 - i);
      exp_run(l + i, inv_t, m, e + i, n);
      sums[i / kBlock] = fsum(e + i, n);
    }
  });
  double z = 0.0;
  for (int64_t j = 0; j < (V + kBlock - 1) / kBlock; ++j) z += sums[j];
  return {e, sums, static_cast<float>(1.0 / z)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> infer_kernels::rejection_sample_logits(const at::Tensor& logits, const at::Tensor& temperature,
                                                           const at::Tensor& drafts,
                                                           const c10::optional<at::Tensor>& q, const at::Tensor& nd,
                                                           const at::Tensor& u, const at::Tensor& u_final,
                                                           const c10::optional<at::Tensor>& q_ids) {
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == at::kFloat, "infer::rejection_sample_logits: logits "
              "must be float32 [B, K+1, V], got ", logits.scalar_type(), " ", logits.sizes());
  const int64_t B = logits.size(0), K = logits.size(1) - 1, V = logits.size(2);
  TORCH_CHECK(K >= 1 && V > 0, "infer::rejection_sample_logits: logits must hold K+1 >= 2 positions over a "
              "vocabulary, got ", logits.sizes());
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == B && temperature.scalar_type() == at::kFloat,
              "infer::rejection_sample_logits: temperature must be float32 [", B, "]");
  Rule rule("infer::rejection_sample_logits", drafts, nd, u, u_final, B, K, V);
  const bool has_q = q.has_value() && q->defined();
  const bool sub = has_q && q_ids.has_value() && q_ids->defined();
  at::Tensor qc, ic;
  int64_t N = V;  // q's columns: the vocabulary, or the draft vocabulary's ids
  if (sub) {
    TORCH_CHECK(q_ids->dim() == 1 && q_ids->scalar_type() == at::kLong && q_ids->size(0) <= V,
                "infer::rejection_sample_logits: q_ids must be int64 [N <= ", V, "], got ", q_ids->sizes());
    ic = q_ids->contiguous();
    N = ic.size(0);
    const int64_t* I = ic.data_ptr<int64_t>();
    std::vector<uint8_t> seen(V, 0);
    for (int64_t k = 0; k < N; ++k) {
      TORCH_CHECK(I[k] >= 0 && I[k] < V && !seen[I[k]], "infer::rejection_sample_logits: q_ids must be distinct "
                  "token ids in [0, ", V, ")");
      seen[I[k]] = 1;
    }
  }
  if (has_q) {
    TORCH_CHECK(q->dim() == 3 && q->size(0) == B && q->size(1) == K && q->size(2) == N &&
                q->scalar_type() == at::kFloat, "infer::rejection_sample_logits: q must be float32 [", B, ", ", K,
                ", ", N, "], got ", q->sizes());
    qc = q->contiguous();
  }
  const int64_t* IDS = sub ? ic.data_ptr<int64_t>() : nullptr;
  // q(t) of position row qr: column t, or t's column among the ids (0 outside them; a few drafts a row: a scan)
  auto q_at = [&](const float* qr, int64_t t) -> float {
    if (!sub) return qr[t];
    const int64_t* it = std::find(IDS, IDS + N, t);
    return it != IDS + N ? qr[it - IDS] : 0.0f;
  };
  const auto lc = logits.contiguous(), tc = temperature.contiguous();
  const float* T = tc.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(T[b] > 0.0f, "infer::rejection_sample_logits: temperature must be > 0, got ", T[b], " (row ", b,
                ")");
  const float* L = lc.data_ptr<float>();
  const float* Q = has_q ? qc.data_ptr<float>() : nullptr;
  // rows apart: a row's draws read its own uniforms only; a lone row's passes over the vocabulary go over the threads
  const bool threads = B == 1;
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> ew(V), rw(has_q ? V : 0);
    std::vector<double> es(blocks), rs(blocks);
    float* e = ew.data();
    for (int64_t b = begin; b < end; ++b) {
      const int64_t nb = rule.drafts_of(b);
      const float inv_t = 1.0f / T[b];
      int64_t n = 0;
      Law pn{};
      for (;; ++n) {
        pn = law(L + (b * (K + 1) + n) * V, inv_t, V, e, es.data(), threads);
        if (n == nb) break;
        const int64_t t = rule.draft(b, n);
        if (!rule.accepts(b, n, pn(t), has_q ? q_at(Q + (b * K + n) * N, t) : 1.0f)) break;
      }
      // the final token: p's weights e (unnormalised: draw_blocks scales its uniform by their total)
      auto whole = [e](int64_t i) { return static_cast<double>(e[i]); };
      const double UF = rule.UF[b];
      int64_t tok;
      if (n == nb) {
        tok = draw_blocks(whole, es.data(), V, UF);
      } else if (has_q) {  // max(0, p - q) in float32, as the torch rule computes it
        const float* qn = Q + (b * K + n) * N;
        float* r = rw.data();
        const Vec iz(pn.iz), zero(0.0f);
        if (sub) {  // q is 0 outside the ids: p there, max(0, p - q) at them
          int64_t i = 0;
          for (; i + Vec::size() <= V; i += Vec::size()) (Vec::loadu(e + i) * iz).store(r + i);
          for (; i < V; ++i) r[i] = e[i] * pn.iz;
          for (int64_t k = 0; k < N; ++k) r[IDS[k]] = std::max(r[IDS[k]] - qn[k], 0.0f);
        }
        double mass = 0.0;
        for (int64_t i = 0; i < V; i += kBlock) {
          const int64_t m = std::min(kBlock, V - i);
          if (!sub) {
            int64_t k = 0;
            for (; k + Vec::size() <= m; k += Vec::size())
              at::vec::maximum(Vec::loadu(e + i + k) * iz - Vec::loadu(qn + i + k), zero).store(r + i + k);
            for (; k < m; ++k) r[i + k] = std::max(e[i + k] * pn.iz - qn[i + k], 0.0f);
          }
          mass += (rs[i / kBlock] = fsum(r + i, m));
        }
        tok = mass > 0.0 ? draw_blocks([r](int64_t i) { return static_cast<double>(r[i]); }, rs.data(), V, UF)
                         : draw_blocks(whole, es.data(), V, UF);
      } else {  // p without the rejected draft t
        const int64_t t = rule.draft(b, n), j = t / kBlock;
        const float et = e[t];
        std::copy(es.begin(), es.end(), rs.begin());
        e[t] = 0.0f;
        rs[j] = fsum(e + j * kBlock, std::min(kBlock, V - j * kBlock));
        double mass = 0.0;
        for (double x : rs) mass += x;
        if (mass > 0.0) {
          tok = draw_blocks(whole, rs.data(), V, UF);
        } else {
          e[t] = et;
          tok = draw_blocks(whole, es.data(), V, UF);
        }
      }
      rule.emit(b, n, tok);
    }
  });
  return {rule.n_out, rule.tokens};
}
