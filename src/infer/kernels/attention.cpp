// infer::attention: softmax(q k^T / sqrt(D)) v over the KV cache, for the few query rows of a decode or verify step.
//
//   q [B, H, T, D], k and v [B, Hkv, L, D] (any strides, unit stride along D; H a multiple of Hkv: grouped-query
//   heads, query head h reads KV head h / (H / Hkv)), mask [B, 1, T, L] bool (True = attend) or None
//   -> o [B, H, T, D], stored as [B, T, H, D] so that the caller's transpose + reshape to [B, T, H * D] is free.
//
// ATen's flash-attention kernel costs ~70 us a call on a decode step's few thousand scores (blocking and thread
// set-up sized for long prefills); this one walks each KV head once for all the query heads that share it.
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

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask,
            std::array<int64_t, 3> mstride, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), L = k.size(2), G = H / Hkv, D8 = D & ~int64_t(7);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();  // [B, T, H, D] contiguous
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t items = B * Hkv * Tq;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, L * D * G));
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> buf;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t t = item % Tq, hk = (item / Tq) % Hkv, b = item / (Tq * Hkv);
      const bool* mrow = mask ? mask + b * mstride[0] + t * mstride[1] : nullptr;
      int64_t len = L;  // keys 0..len-1 are the ones this query may see
      if (mrow)
        while (len > 0 && !mrow[(len - 1) * mstride[2]]) --len;
      if (len == 0) {  // a query that may see nothing (never built by infer's pools): zeros, not NaN
        for (int64_t g = 0; g < G; ++g)
          std::fill_n(op + ((b * Tq + t) * H + hk * G + g) * D, D, static_cast<T>(0.0f));
        continue;
      }
      buf.resize(G * (D + len + D));
      float* qf = buf.data();          // [G, D] the query rows, scaled
      float* sc = qf + G * D;          // [G, len] scores, then probabilities
      float* acc = sc + G * len;       // [G, D] weighted sum of values
      for (int64_t g = 0; g < G; ++g) {
        const T* qr = qp + b * qs[0] + (hk * G + g) * qs[1] + t * qs[2];
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qr[d]) * scale;
      }
      for (int64_t j = 0; j < len; ++j) {
        if (mrow && !mrow[j * mstride[2]]) {
          for (int64_t g = 0; g < G; ++g) sc[g * len + j] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const T* kr = kp + b * ks[0] + hk * ks[1] + j * ks[2];
        for (int64_t g = 0; g < G; ++g) {
          V8 a = zero8();
          for (int64_t d = 0; d < D8; d += 8) a = fma8(load8(kr + d), load8(qf + g * D + d), a);
          float s = hsum8(a);
          for (int64_t d = D8; d < D; ++d) s += to_float(kr[d]) * qf[g * D + d];
          sc[g * len + j] = s;
        }
      }
      using Vec = at::vec::Vectorized<float>;
      for (int64_t g = 0; g < G; ++g) {
        float* s = sc + g * len;
        const float mx = *std::max_element(s, s + len);
        for (int64_t j = 0; j < len; j += Vec::size()) {  // elementwise: a lane's result does not depend on len
          const int64_t n = std::min<int64_t>(Vec::size(), len - j);
          (Vec::loadu(s + j, n) - Vec(mx)).exp_u20().store(s + j, n);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < len; ++j) sum += s[j];
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < len; ++j) s[j] *= inv;
        std::fill(acc + g * D, acc + (g + 1) * D, 0.0f);
      }
      for (int64_t j = 0; j < len; ++j) {
        if (mrow && !mrow[j * mstride[2]]) continue;
        const T* vr = vp + b * vs[0] + hk * vs[1] + j * vs[2];
        for (int64_t g = 0; g < G; ++g) {
          const V8 p = set8(sc[g * len + j]);
          float* a = acc + g * D;
          for (int64_t d = 0; d < D8; d += 8) store8(a + d, fma8(p, load8(vr + d), load8(a + d)));
          for (int64_t d = D8; d < D; ++d) a[d] += sc[g * len + j] * to_float(vr[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* o = op + ((b * Tq + t) * H + hk * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[g * D + d]);
      }
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
