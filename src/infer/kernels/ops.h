// The ops' entries as C++ functions (each defined in its own file, registered there as infer::<name>), for kernels
// that chain them without the dispatcher: eagle_round.cpp runs an EAGLE-3 draft round through them.
#pragma once

#include <ATen/ATen.h>

namespace infer_kernels {

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t out_features,
                   const c10::optional<at::Tensor>& lens, bool float_out);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const c10::optional<at::Tensor>& lens);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim,
                const c10::optional<at::Tensor>& lens);
at::Tensor silu_mul(const at::Tensor& x, const c10::optional<at::Tensor>& lens);
at::Tensor attention(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
                     const c10::optional<at::Tensor>& mask_in, const c10::optional<at::Tensor>& rows_in,
                     const c10::optional<at::Tensor>& lens_in);

}  // namespace infer_kernels
