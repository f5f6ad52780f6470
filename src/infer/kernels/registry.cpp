// The ops' registrations as infer::<name>, in one file: torch/library.h alone is ~7 s of parsing, paid here once
// instead of by every kernel's file. Each op's schema is its Python signature (infer.kernels registers the shapes
// torch.compile traces); each entry is defined beside its kernel (ops.h says where).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY_FRAGMENT(infer, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? scale=None, Tensor? lens=None) -> Tensor");
  m.def("qlinear(Tensor x, Tensor packed, int format, int out_features, Tensor? lens=None, bool float_out=False) -> "
        "Tensor");
  m.def("qlinear_pairs(bool on) -> bool", &infer_kernels::qlinear_pairs);  // no tensors: one kernel for every key
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask=None, Tensor? rows=None, Tensor? lens=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? lens=None) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, int heads, int head_dim, Tensor? lens=None) -> Tensor");
  m.def("silu_mul(Tensor x, Tensor? lens=None) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("rejection_sample(Tensor p, Tensor drafts, Tensor? q, Tensor nd, Tensor u, Tensor u_final) -> (Tensor, "
        "Tensor)");
  m.def("rejection_sample_logits(Tensor logits, Tensor temperature, Tensor drafts, Tensor? q, Tensor nd, Tensor u, "
        "Tensor u_final, Tensor? q_ids=None) -> (Tensor, Tensor)");
  m.def("eagle3_round(Tensor tokens, Tensor features, Tensor[] packed, int[] formats, int[] outs, Tensor[] norms, "
        "float eps, Tensor embed, Tensor draft_ids, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor table, int block_size, int start, int heads, int kv_heads, int head_dim, Tensor temperature, "
        "Tensor u, Tensor? screen=None, int screen_top=0, Tensor? stop_cal=None, Tensor? stop_below=None) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
  m.def("draft_lm_round(Tensor tokens, Tensor[] packed, int[] formats, int[] outs, Tensor[] norms, float eps, "
        "Tensor embed, Tensor vocab_packed, int vocab_format, Tensor? extra_weight, Tensor vocab_ids, Tensor cos, "
        "Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor table, int block_size, int start, int heads, "
        "int kv_heads, int head_dim, Tensor temperature, Tensor u) -> (Tensor, Tensor)");
  m.def("llama_forward(Tensor tokens, Tensor[] packed, int[] formats, int[] outs, Tensor[] norms, float eps, "
        "Tensor embed, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor rows, int start, "
        "int heads, int kv_heads, int head_dim, int[] aux, Tensor[] lora) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer, CPU, m) {
  m.impl("linear", &infer_kernels::linear);
  m.impl("qlinear", &infer_kernels::qlinear);
  m.impl("attention", &infer_kernels::attention);
  m.impl("rms_norm", &infer_kernels::rms_norm);
  m.impl("rope", &infer_kernels::rope);
  m.impl("silu_mul", &infer_kernels::silu_mul);
  m.impl("argmax", &infer_kernels::argmax);
  m.impl("rejection_sample", &infer_kernels::rejection_sample);
  m.impl("rejection_sample_logits", &infer_kernels::rejection_sample_logits);
  m.impl("eagle3_round", &infer_kernels::eagle3_round);
  m.impl("draft_lm_round", &infer_kernels::draft_lm_round);
  m.impl("llama_forward", &infer_kernels::llama_forward);
}
