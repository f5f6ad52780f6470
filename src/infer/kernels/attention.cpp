// infer::attention: softmax(q k^T / sqrt(D)) v over the KV cache, for the few query rows of a decode or verify step.
//
//   q [B, H, T, D], k and v [B, Hkv, L, D] (any strides, unit stride along D; H a multiple of Hkv: grouped-query
//   heads, query head h reads KV head h / (H / Hkv)), mask [B, 1, T, L] bool (True = attend) or None
//   -> o [B, H, T, D], stored as [B, T, H, D] so that the caller's transpose + reshape to [B, T, H * D] is free.
//
// ATen's flash-attention kernel costs ~70 us a call on a decode step's few thousand scores (blocking and thread
// set-up sized for long prefills); this one splits the step's (query, head) pairs over the threads and keeps the
// weighted sum of values in registers.
//
// Batch invariance: a query attends to the keys before the last one its mask allows, in order; scores, the
// softmax sums and the weighted sum of values are accumulated in the same order whatever L, T or B are. A token's
// attention output is therefore the same alone (decode, L = its position + 1) and among K+1 (verify, larger L,
// later keys masked).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec8.h"

namespace {

using namespace infer_kernels;

// q . k for one key row: 8-lane partial sums over D (one chain per key), then the scalar tail. The same order for
// every key, whether it is computed alone or beside three others (dot4 interleaves four independent chains to hide
// the FMA latency; each key's arithmetic is unchanged).
template <typename T>
inline float dot(const float* q, const T* k, int64_t D, int64_t D8) {
  V8 a = zero8();
  for (int64_t d = 0; d < D8; d += 8) a = fma8(load8(k + d), load8(q + d), a);
  float s = hsum8(a);
  for (int64_t d = D8; d < D; ++d) s += to_float(k[d]) * q[d];
  return s;
}

template <typename T>
inline void dot4(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, int64_t D, int64_t D8,
                 float* out) {
  V8 a0 = zero8(), a1 = zero8(), a2 = zero8(), a3 = zero8();
  for (int64_t d = 0; d < D8; d += 8) {
    const V8 qd = load8(q + d);
    a0 = fma8(load8(k0 + d), qd, a0);
    a1 = fma8(load8(k1 + d), qd, a1);
    a2 = fma8(load8(k2 + d), qd, a2);
    a3 = fma8(load8(k3 + d), qd, a3);
  }
  const T* ks[4] = {k0, k1, k2, k3};
  const float h[4] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};
  for (int i = 0; i < 4; ++i) {
    float s = h[i];
    for (int64_t d = D8; d < D; ++d) s += to_float(ks[i][d]) * q[d];
    out[i] = s;
  }
}

// One (batch row, query, head): o = sum_j p_j v_j over the keys it sees, accumulated in key order. The output row is
// walked in blocks of 64 lanes held in registers (8 independent chains); D % 8 trailing lanes in scalar.
template <typename T>
void attend_one(const float* qf, const T* kp, const T* vp, int64_t kstride, int64_t vstride, const bool* mrow,
                int64_t mstride, int64_t len, int64_t D, float* sc, T* o) {
  const int64_t D8 = D & ~int64_t(7);
  auto visible = [&](int64_t j) { return !mrow || mrow[j * mstride]; };
  int64_t j = 0;
  for (; j + 4 <= len; j += 4)
    dot4(qf, kp + j * kstride, kp + (j + 1) * kstride, kp + (j + 2) * kstride, kp + (j + 3) * kstride, D, D8, sc + j);
  for (; j < len; ++j) sc[j] = dot(qf, kp + j * kstride, D, D8);
  for (j = 0; j < len; ++j)
    if (!visible(j)) sc[j] = -std::numeric_limits<float>::infinity();
  using Vec = at::vec::Vectorized<float>;
  const float mx = *std::max_element(sc, sc + len);
  for (j = 0; j < len; j += Vec::size()) {  // elementwise: a lane's result does not depend on len
    const int64_t n = std::min<int64_t>(Vec::size(), len - j);
    (Vec::loadu(sc + j, n) - Vec(mx)).exp_u20().store(sc + j, n);
  }
  float sum = 0.0f;
  for (j = 0; j < len; ++j) sum += sc[j];
  const float inv = 1.0f / sum;
  for (j = 0; j < len; ++j) sc[j] *= inv;
  for (int64_t d0 = 0; d0 < D8; d0 += 64) {
    const int64_t nv = std::min<int64_t>(64, D8 - d0) / 8;
    V8 a[8] = {zero8(), zero8(), zero8(), zero8(), zero8(), zero8(), zero8(), zero8()};
    for (j = 0; j < len; ++j) {
      if (!visible(j)) continue;
      const V8 p = set8(sc[j]);
      const T* vr = vp + j * vstride + d0;
      if (nv == 8) {  // the usual D = 64/128 block: a constant trip count keeps a[0..7] in registers
        for (int i = 0; i < 8; ++i) a[i] = fma8(p, load8(vr + 8 * i), a[i]);
      } else {
        for (int i = 0; i < nv; ++i) a[i] = fma8(p, load8(vr + 8 * i), a[i]);
      }
    }
    float tmp[8];
    for (int i = 0; i < nv; ++i) {
      store8(tmp, a[i]);
      for (int l = 0; l < 8; ++l) o[d0 + 8 * i + l] = static_cast<T>(tmp[l]);
    }
  }
  for (int64_t d = D8; d < D; ++d) {
    float acc = 0.0f;
    for (j = 0; j < len; ++j)
      if (visible(j)) acc += sc[j] * to_float(vp[j * vstride + d]);
    o[d] = static_cast<T>(acc);
  }
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask,
            std::array<int64_t, 3> mstride, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), L = k.size(2), G = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();  // [B, T, H, D] contiguous
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // one item per (batch row, query, head); query heads of one KV head read the same rows (L2-resident)
  const int64_t items = B * Tq * H;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, L * D));
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> buf;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t h = item % H, t = (item / H) % Tq, b = item / (H * Tq), hk = h / G;
      const bool* mrow = mask ? mask + b * mstride[0] + t * mstride[1] : nullptr;
      T* o = op + ((b * Tq + t) * H + h) * D;
      int64_t len = L;  // keys 0..len-1 are the ones this query may see
      if (mrow)
        while (len > 0 && !mrow[(len - 1) * mstride[2]]) --len;
      if (len == 0) {  // a query that may see nothing (never built by infer's pools): zeros, not NaN
        std::fill_n(o, D, static_cast<T>(0.0f));
        continue;
      }
      buf.resize(D + len);
      float* qf = buf.data();  // [D] the query row, scaled
      float* sc = qf + D;      // [len] scores, then probabilities
      const T* qr = qp + b * qs[0] + h * qs[1] + t * qs[2];
      for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(qr[d]) * scale;
      attend_one<T>(qf, kp + b * ks[0] + hk * ks[1], vp + b * vs[0] + hk * vs[1], ks[2], vs[2], mrow, mstride[2], len,
                    D, sc, o);
    }
  });
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
                     const c10::optional<at::Tensor>& mask_in) {
  TORCH_CHECK(q.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4, "infer::attention: 4-d q, k, v expected");
  TORCH_CHECK(q.device().is_cpu(), "infer::attention runs on the CPU");
  TORCH_CHECK(q.scalar_type() == k_in.scalar_type() && q.scalar_type() == v_in.scalar_type(),
              "infer::attention: q, k and v must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "infer::attention: float32 or bfloat16 expected, got ", q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  TORCH_CHECK(k_in.size(0) == B && v_in.size(0) == B && k_in.size(3) == D && v_in.size(3) == D &&
              k_in.size(2) == v_in.size(2) && k_in.size(1) == v_in.size(1) && k_in.size(1) > 0 &&
              H % k_in.size(1) == 0, "infer::attention: shapes do not match: q ", q.sizes(), ", k ", k_in.sizes(),
              ", v ", v_in.sizes());
  // the kernel reads rows of D along the last dimension
  auto unit = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  auto qq = unit(q), k = unit(k_in), v = unit(v_in);
  const bool* mask = nullptr;
  std::array<int64_t, 3> ms{0, 0, 0};
  at::Tensor m;
  if (mask_in.has_value()) {
    m = *mask_in;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(1) == 1 &&
                (m.size(0) == B || m.size(0) == 1) && m.size(2) == Tq && m.size(3) == k.size(2),
                "infer::attention: mask must be bool [B, 1, T, L], got ", m.sizes(), " ", m.scalar_type());
    mask = m.data_ptr<bool>();
    ms = {m.size(0) == 1 ? 0 : m.stride(0), m.stride(2), m.stride(3)};
  }
  auto out = at::empty({B, Tq, H, D}, q.options());
  if (q.scalar_type() == at::kFloat) attend<float>(qq, k, v, mask, ms, out);
  else attend<c10::BFloat16>(qq, k, v, mask, ms, out);
  return out.transpose(1, 2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer, CPU, m) {
  m.impl("attention", &attention);
}
