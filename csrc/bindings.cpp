// The torch face of the csrc kernels: the only file that includes torch headers.
//
// Registration: TORCH_LIBRARY(lightning_moe_C, ...) with CUDA implementations, so the ops are
// dispatcher ops, callable as torch.ops.lightning_moe_C.<name> and visible to torch.compile
// once the Python side registers fake (meta) kernels for them. No pybind11 module:
// lightning_moe/ops/build.py loads the library with is_python_module=False and returns the
// op namespace torch.ops.lightning_moe_C.
//
// Each op: validate (device, dtype, contiguity, shapes; messages name the op, the argument and
// the bad value), allocate the outputs, launch on the current stream of the inputs' device,
// raise if the launch failed. Nothing here synchronises with the host.
//
// Legend: T tokens, H hidden, F expert FFN width, E experts, K top-k, N = T*K, R rows, S
// source rows.

#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "moe_kernels.cuh"

namespace lightning_moe {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// "[a, b, c]": sizes and strides in error messages, formatted here rather than through
// ArrayRef's stream operator.
// Numbers likewise go through std::to_string: streaming an integer into the message from this
// library crashed on the GPU machine (the int64 cases, not the string ones).
std::string num(int64_t value) { return std::to_string(value); }

std::string dims(c10::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(values[i]);
  }
  return out + "]";
}

void check_tensor(const at::Tensor& t, const char* op, const char* name, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), "lightning_moe_C.", op, ": ", name, " is on ", t.device(),
              "; every input must be a CUDA tensor (use the torch path on CPU).");
  TORCH_CHECK(t.device() == device, "lightning_moe_C.", op, ": ", name, " is on ", t.device(),
              " but the first input is on ", device, "; move all inputs to one device.");
  TORCH_CHECK(t.is_contiguous(), "lightning_moe_C.", op, ": ", name, " with shape ", dims(t.sizes()),
              " and strides ", dims(t.strides()), " is not contiguous; pass ", name, ".contiguous().");
}

void check_dtype(const at::Tensor& t, const char* op, const char* name, at::ScalarType want) {
  TORCH_CHECK(t.scalar_type() == want, "lightning_moe_C.", op, ": ", name, ".dtype=",
              t.scalar_type(), " must be ", want, ".");
}

void check_dim(const at::Tensor& t, const char* op, const char* name, int64_t dim,
               const char* shape) {
  TORCH_CHECK(t.dim() == dim, "lightning_moe_C.", op, ": ", name, " has shape ", dims(t.sizes()),
              "; expected ", shape, ".");
}

// Activations: fp32, bf16 or fp16.
DType activation_dtype(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default:
      TORCH_CHECK(false, "lightning_moe_C.", op, ": ", name, ".dtype=", t.scalar_type(),
                  " is not supported; use float32, bfloat16 or float16.");
  }
  return DType::kFloat32;  // unreachable
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "lightning_moe_C.", op, ": kernel launch failed: ",
              cudaGetErrorString(err));
}

cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

// The checks the row ops begin with, in this order: `rows` (activations, [*, H]) and its int32
// index tensor on rows' CUDA device and contiguous, both of their stated ranks; returns rows' dtype.
DType check_rows_and_index(const at::Tensor& rows, const char* rows_name, const char* rows_shape,
                           const at::Tensor& index, const char* index_name, int64_t index_dim,
                           const char* index_shape, const char* op) {
  const at::Device dev = rows.device();
  check_tensor(rows, op, rows_name, dev);
  check_tensor(index, op, index_name, dev);
  check_dim(rows, op, rows_name, 2, rows_shape);
  check_dim(index, op, index_name, index_dim, index_shape);
  check_dtype(index, op, index_name, at::kInt);
  return activation_dtype(rows, op, rows_name);
}

// ---------------------------------------------------------------------------------------------

// out[R, H] = x[src_idx[r]] (* row_scale[r]); src_idx[r] = -1 gives a zero row.
at::Tensor permute_rows_op(const at::Tensor& x, const at::Tensor& src_idx,
                           const std::optional<at::Tensor>& row_scale) {
  constexpr const char* op = "permute_rows";
  const at::Device dev = x.device();
  const DType dt = check_rows_and_index(x, "x", "[S, H]", src_idx, "src_idx", 1, "[R]", op);
  const int64_t R = src_idx.size(0);
  TORCH_CHECK(x.size(0) <= kInt32Max, "lightning_moe_C.", op, ": x has ", num(x.size(0)),
              " rows; int32 row indices address at most ", num(kInt32Max), ".");
  if (row_scale.has_value()) {
    check_tensor(*row_scale, op, "row_scale", dev);
    check_dtype(*row_scale, op, "row_scale", at::kFloat);
    TORCH_CHECK(row_scale->dim() == 1 && row_scale->size(0) == R, "lightning_moe_C.", op,
                ": row_scale has shape ", dims(row_scale->sizes()), "; expected [R] = [", num(R), "].");
  }
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor out = at::empty({R, x.size(1)}, x.options());
  check_launch(permute_rows(x.data_ptr(), src_idx.data_ptr<int32_t>(),
                            row_scale.has_value() ? row_scale->data_ptr<float>() : nullptr,
                            out.data_ptr(), R, x.size(0), x.size(1), dt, current_stream()),
               op);
  return out;
}

// out[R, H] with out[slot_row[t, k]] = x[t]: the gather of permute_rows when every row has exactly
// one slot (the caller's promise: rows no slot names are left unwritten).
at::Tensor scatter_rows_op(const at::Tensor& x, const at::Tensor& slot_row, int64_t num_rows) {
  constexpr const char* op = "scatter_rows";
  const at::Device dev = x.device();
  const DType dt = check_rows_and_index(x, "x", "[T, H]", slot_row, "slot_row", 2, "[T, K]", op);
  TORCH_CHECK(slot_row.size(0) == x.size(0), "lightning_moe_C.", op, ": slot_row has ", num(slot_row.size(0)),
              " tokens, x has ", num(x.size(0)), "; both are [T, ...].");
  TORCH_CHECK(num_rows >= 0 && num_rows <= kInt32Max, "lightning_moe_C.", op, ": num_rows=", num(num_rows),
              " must be in [0, ", num(kInt32Max), "] (int32 row indices).");
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor out = at::empty({num_rows, x.size(1)}, x.options());
  check_launch(scatter_rows(x.data_ptr(), slot_row.data_ptr<int32_t>(), out.data_ptr(), x.size(0),
                            slot_row.size(1), num_rows, x.size(1), dt, current_stream()),
               op);
  return out;
}

// out[T, H] = sum_k w[t, k] * y[slot_row[t, k]] (rows -1 skipped; fp32 accumulation).
at::Tensor unpermute_sum_op(const at::Tensor& y, const at::Tensor& slot_row,
                            const std::optional<at::Tensor>& weights) {
  constexpr const char* op = "unpermute_sum";
  const at::Device dev = y.device();
  const DType dt = check_rows_and_index(y, "y", "[R, H]", slot_row, "slot_row", 2, "[T, K]", op);
  if (weights.has_value()) {
    check_tensor(*weights, op, "weights", dev);
    check_dtype(*weights, op, "weights", at::kFloat);
    TORCH_CHECK(weights->sizes() == slot_row.sizes(), "lightning_moe_C.", op,
                ": weights has shape ", dims(weights->sizes()), " but slot_row has ", dims(slot_row.sizes()),
                "; they must match ([T, K]).");
  }
  const c10::cuda::CUDAGuard guard(dev);
  const int64_t T = slot_row.size(0), K = slot_row.size(1);
  at::Tensor out = at::empty({T, y.size(1)}, y.options());
  check_launch(unpermute_sum(y.data_ptr(), slot_row.data_ptr<int32_t>(),
                             weights.has_value() ? weights->data_ptr<float>() : nullptr,
                             out.data_ptr(), T, K, y.size(1), dt, current_stream()),
               op);
  return out;
}

// grad_w[T, K] (fp32) = <grad_out[t], y[slot_row[t, k]]>, 0 where slot_row is -1.
at::Tensor unpermute_weight_grad_op(const at::Tensor& grad_out, const at::Tensor& y,
                                    const at::Tensor& slot_row) {
  constexpr const char* op = "unpermute_weight_grad";
  const at::Device dev = grad_out.device();
  check_tensor(grad_out, op, "grad_out", dev);
  check_tensor(y, op, "y", dev);
  check_tensor(slot_row, op, "slot_row", dev);
  check_dim(grad_out, op, "grad_out", 2, "[T, H]");
  check_dim(y, op, "y", 2, "[R, H]");
  check_dim(slot_row, op, "slot_row", 2, "[T, K]");
  check_dtype(slot_row, op, "slot_row", at::kInt);
  const DType dt = activation_dtype(grad_out, op, "grad_out");
  check_dtype(y, op, "y", grad_out.scalar_type());
  TORCH_CHECK(y.size(1) == grad_out.size(1), "lightning_moe_C.", op, ": y has H=", num(y.size(1)),
              " but grad_out has H=", num(grad_out.size(1)), "; they must match.");
  TORCH_CHECK(slot_row.size(0) == grad_out.size(0), "lightning_moe_C.", op, ": slot_row has T=",
              num(slot_row.size(0)), " but grad_out has T=", num(grad_out.size(0)), "; they must match.");
  const c10::cuda::CUDAGuard guard(dev);
  const int64_t T = slot_row.size(0), K = slot_row.size(1);
  at::Tensor grad_w = at::empty({T, K}, grad_out.options().dtype(at::kFloat));
  check_launch(unpermute_weight_grad(grad_out.data_ptr(), y.data_ptr(),
                                     slot_row.data_ptr<int32_t>(), grad_w.data_ptr<float>(), T, K,
                                     grad_out.size(1), dt, current_stream()),
               op);
  return grad_w;
}

// a[R, F] = silu(h[:, :F]) * h[:, F:] * w[:, None].
at::Tensor weighted_swiglu_fwd_op(const at::Tensor& h, const std::optional<at::Tensor>& w) {
  constexpr const char* op = "weighted_swiglu_fwd";
  const at::Device dev = h.device();
  check_tensor(h, op, "h", dev);
  check_dim(h, op, "h", 2, "[R, 2F]");
  TORCH_CHECK(h.size(1) % 2 == 0, "lightning_moe_C.", op, ": h has ", num(h.size(1)),
              " columns; expected an even 2F = [gate | up].");
  const DType dt = activation_dtype(h, op, "h");
  const int64_t R = h.size(0), F = h.size(1) / 2;
  if (w.has_value()) {
    check_tensor(*w, op, "w", dev);
    check_dtype(*w, op, "w", at::kFloat);
    TORCH_CHECK(w->dim() == 1 && w->size(0) == R, "lightning_moe_C.", op, ": w has shape ",
                dims(w->sizes()), "; expected [R] = [", num(R), "].");
  }
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor a = at::empty({R, F}, h.options());
  check_launch(weighted_swiglu_fwd(h.data_ptr(), w.has_value() ? w->data_ptr<float>() : nullptr,
                                   a.data_ptr(), R, F, dt, current_stream()),
               op);
  return a;
}

// The fp32 rotary tables cos, sin [P, D/2] of x [T, N, D]: one row per position or per token (T % P == 0).
void check_rope_tables(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const char* op) {
  const int64_t half = x.size(2) / 2;
  for (const at::Tensor* t : {&cos, &sin}) {
    const char* name = t == &cos ? "cos" : "sin";
    check_tensor(*t, op, name, x.device());
    check_dtype(*t, op, name, at::kFloat);
    TORCH_CHECK(t->dim() == 2 && t->size(1) == half && t->size(0) > 0, "lightning_moe_C.", op, ": ", name,
                " has shape ", dims(t->sizes()), "; expected [P, D/2] = [P, ", num(half), "] with P > 0.");
  }
  TORCH_CHECK(sin.size(0) == cos.size(0), "lightning_moe_C.", op, ": cos has ", num(cos.size(0)),
              " rows but sin has ", num(sin.size(0)), "; pass tables of one length.");
  TORCH_CHECK(x.size(0) % cos.size(0) == 0, "lightning_moe_C.", op, ": x has ", num(x.size(0)),
              " tokens, not a multiple of the ", num(cos.size(0)),
              " table rows; pass one row per position [S, D/2] or per token [T, D/2].");
}

// Rotary embedding of x [T, N, D] (token-major heads) with fp32 tables cos, sin [P, D/2]: token t
// reads row t % P. backward=true applies the transposed rotation (the gradient of the forward).
at::Tensor rope_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  constexpr const char* op = "rope";
  const at::Device dev = x.device();
  check_tensor(x, op, "x", dev);
  check_dim(x, op, "x", 3, "[T, N, D]");
  TORCH_CHECK(x.size(2) % 2 == 0, "lightning_moe_C.", op, ": x has head dim ", num(x.size(2)),
              "; rotary embedding needs an even D.");
  const DType dt = activation_dtype(x, op, "x");
  const int64_t T = x.size(0), N = x.size(1), half = x.size(2) / 2;
  check_rope_tables(x, cos, sin, op);
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor out = at::empty_like(x);
  check_launch(rope(x.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr(), T * N, half, N,
                    cos.size(0), backward, dt, current_stream()),
               op);
  return out;
}

void check_ce_inputs(const at::Tensor& x, const at::Tensor& labels, const char* op) {
  const at::Device dev = x.device();
  check_tensor(x, op, "x", dev);
  check_dim(x, op, "x", 2, "[T, V]");
  check_tensor(labels, op, "labels", dev);
  check_dtype(labels, op, "labels", at::kLong);
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == x.size(0), "lightning_moe_C.", op, ": labels has shape ",
              dims(labels.sizes()), "; expected [T] = [", num(x.size(0)), "].");
}

// (loss[T], lse[T]), both fp32: the per-token cross-entropy of x [T, V] and its log-sum-exp.
std::tuple<at::Tensor, at::Tensor> cross_entropy_fwd_op(const at::Tensor& x, const at::Tensor& labels,
                                                        int64_t ignore_index) {
  constexpr const char* op = "cross_entropy_fwd";
  check_ce_inputs(x, labels, op);
  const DType dt = activation_dtype(x, op, "x");
  TORCH_CHECK(x.size(1) > 0 || x.size(0) == 0, "lightning_moe_C.", op, ": x has shape ", dims(x.sizes()),
              "; a vocabulary of 0 has no cross-entropy.");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor loss = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  check_launch(cross_entropy_fwd(x.data_ptr(), labels.data_ptr<int64_t>(), loss.data_ptr<float>(),
                                 lse.data_ptr<float>(), x.size(0), x.size(1), ignore_index, dt, current_stream()),
               op);
  return {loss, lse};
}

// grad_x [T, V] in x's dtype from the fp32 per-token loss gradient grad_loss [T].
at::Tensor cross_entropy_bwd_op(const at::Tensor& x, const at::Tensor& labels, const at::Tensor& lse,
                                const at::Tensor& grad_loss, int64_t ignore_index) {
  constexpr const char* op = "cross_entropy_bwd";
  check_ce_inputs(x, labels, op);
  const DType dt = activation_dtype(x, op, "x");
  const auto check_row_vector = [&](const at::Tensor& t, const char* name) {
    check_tensor(t, op, name, x.device());
    check_dtype(t, op, name, at::kFloat);
    TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(0), "lightning_moe_C.", op, ": ", name, " has shape ",
                dims(t.sizes()), "; expected [T] = [", num(x.size(0)), "].");
  };
  check_row_vector(lse, "lse");
  check_row_vector(grad_loss, "grad_loss");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor grad_x = at::empty_like(x);
  check_launch(cross_entropy_bwd(x.data_ptr(), labels.data_ptr<int64_t>(), lse.data_ptr<float>(),
                                 grad_loss.data_ptr<float>(), grad_x.data_ptr(), x.size(0), x.size(1), ignore_index,
                                 dt, current_stream()),
               op);
  return grad_x;
}

// Checks shared by the fused query/key norm + rotary ops: x [T, N, D] with D in {64, 128, 192, 256},
// w [D] of x's dtype, fp32 tables [P, D/2] with T % P == 0.
void check_qk_norm_rope(const at::Tensor& x, const at::Tensor& w, const at::Tensor& cos, const at::Tensor& sin,
                        const char* op) {
  const at::Device dev = x.device();
  check_tensor(x, op, "x", dev);
  check_dim(x, op, "x", 3, "[T, N, D]");
  const int64_t D = x.size(2);
  TORCH_CHECK(D == 64 || D == 128 || D == 192 || D == 256, "lightning_moe_C.", op, ": head dim D=", num(D),
              " is not one of 64, 128, 192, 256; use the unfused norm and rope.");
  check_tensor(w, op, "w", dev);
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.size(0) == D, "lightning_moe_C.", op,
              ": w has shape ", dims(w.sizes()), " and dtype ", w.scalar_type(), "; expected [", num(D), "] of ",
              x.scalar_type(), ".");
  check_rope_tables(x, cos, sin, op);
}

// (y [T, N, D] in x's dtype, rstd [T * N] fp32).
std::tuple<at::Tensor, at::Tensor> qk_norm_rope_fwd_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& cos,
                                                       const at::Tensor& sin, double eps) {
  constexpr const char* op = "qk_norm_rope_fwd";
  check_qk_norm_rope(x, w, cos, sin, op);
  const DType dt = activation_dtype(x, op, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t R = x.size(0) * x.size(1);
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({R}, x.options().dtype(at::kFloat));
  check_launch(qk_norm_rope_fwd(x.data_ptr(), w.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                y.data_ptr(), rstd.data_ptr<float>(), R, x.size(2), x.size(1), cos.size(0),
                                static_cast<float>(eps), dt, current_stream()),
               op);
  return {y, rstd};
}

// (dx [T, N, D] in x's dtype, dw_partial [blocks, D] fp32: sum over dim 0 for dw).
std::tuple<at::Tensor, at::Tensor> qk_norm_rope_bwd_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& cos,
                                                       const at::Tensor& sin, const at::Tensor& rstd,
                                                       const at::Tensor& g) {
  constexpr const char* op = "qk_norm_rope_bwd";
  check_qk_norm_rope(x, w, cos, sin, op);
  const DType dt = activation_dtype(x, op, "x");
  check_tensor(g, op, "g", x.device());
  TORCH_CHECK(g.sizes() == x.sizes() && g.scalar_type() == x.scalar_type(), "lightning_moe_C.", op, ": g has shape ",
              dims(g.sizes()), "; expected x's ", dims(x.sizes()), " and dtype.");
  const int64_t R = x.size(0) * x.size(1);
  check_tensor(rstd, op, "rstd", x.device());
  check_dtype(rstd, op, "rstd", at::kFloat);
  TORCH_CHECK(rstd.dim() == 1 && rstd.size(0) == R, "lightning_moe_C.", op, ": rstd has shape ", dims(rstd.sizes()),
              "; expected [T * N] = [", num(R), "].");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  at::Tensor dw_partial = at::empty({R > 0 ? qk_norm_rope_grid(R) : 0, x.size(2)}, x.options().dtype(at::kFloat));
  check_launch(qk_norm_rope_bwd(x.data_ptr(), w.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                rstd.data_ptr<float>(), g.data_ptr(), dx.data_ptr(), dw_partial.data_ptr<float>(), R,
                                x.size(2), x.size(1), cos.size(0), dt, current_stream()),
               op);
  return {dx, dw_partial};
}

// (grad_h[R, 2F], grad_w[R] fp32 or None). grad_w is computed iff need_grad_w.
std::tuple<at::Tensor, std::optional<at::Tensor>> weighted_swiglu_bwd_op(
    const at::Tensor& h, const std::optional<at::Tensor>& w, const at::Tensor& grad_a,
    bool need_grad_w) {
  constexpr const char* op = "weighted_swiglu_bwd";
  const at::Device dev = h.device();
  check_tensor(h, op, "h", dev);
  check_tensor(grad_a, op, "grad_a", dev);
  check_dim(h, op, "h", 2, "[R, 2F]");
  check_dim(grad_a, op, "grad_a", 2, "[R, F]");
  TORCH_CHECK(h.size(1) % 2 == 0, "lightning_moe_C.", op, ": h has ", num(h.size(1)),
              " columns; expected an even 2F = [gate | up].");
  const DType dt = activation_dtype(h, op, "h");
  check_dtype(grad_a, op, "grad_a", h.scalar_type());
  const int64_t R = h.size(0), F = h.size(1) / 2;
  TORCH_CHECK(grad_a.size(0) == R && grad_a.size(1) == F, "lightning_moe_C.", op,
              ": grad_a has shape ", dims(grad_a.sizes()), "; expected [R, F] = [", num(R), ", ", num(F), "].");
  if (w.has_value()) {
    check_tensor(*w, op, "w", dev);
    check_dtype(*w, op, "w", at::kFloat);
    TORCH_CHECK(w->dim() == 1 && w->size(0) == R, "lightning_moe_C.", op, ": w has shape ",
                dims(w->sizes()), "; expected [R] = [", num(R), "].");
  }
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor grad_h = at::empty({R, 2 * F}, h.options());
  std::optional<at::Tensor> grad_w;
  if (need_grad_w) grad_w = at::empty({R}, h.options().dtype(at::kFloat));
  check_launch(weighted_swiglu_bwd(h.data_ptr(), w.has_value() ? w->data_ptr<float>() : nullptr,
                                   grad_a.data_ptr(), grad_h.data_ptr(),
                                   need_grad_w ? grad_w->data_ptr<float>() : nullptr, R, F, dt,
                                   current_stream()),
               op);
  return {grad_h, grad_w};
}

// (src_idx[N], slot_row[T, K], counts[E], offsets[E]), all int32; see moe_kernels.cuh.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> build_permutation_op(
    const at::Tensor& topk_ids, int64_t num_experts) {
  constexpr const char* op = "build_permutation";
  const at::Device dev = topk_ids.device();
  check_tensor(topk_ids, op, "topk_ids", dev);
  check_dim(topk_ids, op, "topk_ids", 2, "[T, K]");
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
              "lightning_moe_C.", op, ": topk_ids.dtype=", topk_ids.scalar_type(),
              " must be int32 or int64.");
  TORCH_CHECK(num_experts >= 1 && num_experts <= kMaxPermuteExperts, "lightning_moe_C.", op,
              ": num_experts=", num(num_experts), " must be in [1, ", num(kMaxPermuteExperts), "].");
  const int64_t T = topk_ids.size(0), K = topk_ids.size(1), N = T * K;
  TORCH_CHECK(N <= kInt32Max, "lightning_moe_C.", op, ": T*K=", num(N),
              " slots exceed int32 row indices (max ", num(kInt32Max), "); split the batch.");
  const c10::cuda::CUDAGuard guard(dev);
  const auto i32 = topk_ids.options().dtype(at::kInt);
  at::Tensor src_idx = at::empty({N}, i32);
  at::Tensor slot_row = at::empty({T, K}, i32);
  at::Tensor counts = at::empty({num_experts}, i32);
  at::Tensor offsets = at::empty({num_experts}, i32);
  const size_t ws_bytes = build_permutation_workspace_bytes(N, num_experts);
  at::Tensor workspace =
      at::empty({static_cast<int64_t>(ws_bytes)}, topk_ids.options().dtype(at::kByte));
  check_launch(build_permutation(topk_ids.data_ptr(), topk_ids.scalar_type() == at::kLong, T, K,
                                 num_experts, src_idx.data_ptr<int32_t>(),
                                 slot_row.data_ptr<int32_t>(), counts.data_ptr<int32_t>(),
                                 offsets.data_ptr<int32_t>(), workspace.data_ptr(), ws_bytes,
                                 current_stream()),
               op);
  return {src_idx, slot_row, counts, offsets};
}

// (topk_ids[T, K] int32, topk_weights[T, K] fp32); semantics in routing.cu.
std::tuple<at::Tensor, at::Tensor> router_topk_op(const at::Tensor& logits,
                                                  const std::optional<at::Tensor>& bias,
                                                  int64_t top_k, c10::string_view score_func,
                                                  bool pre_softmax, bool norm_topk_prob,
                                                  double scaling_factor, int64_t num_groups,
                                                  int64_t group_topk) {
  constexpr const char* op = "router_topk";
  const at::Device dev = logits.device();
  check_tensor(logits, op, "logits", dev);
  check_dim(logits, op, "logits", 2, "[T, E]");
  check_dtype(logits, op, "logits", at::kFloat);
  const int64_t T = logits.size(0), E = logits.size(1);
  ScoreFunc sf = ScoreFunc::kSoftmax;
  if (score_func == "sigmoid") {
    sf = ScoreFunc::kSigmoid;
  } else {
    TORCH_CHECK(score_func == "softmax", "lightning_moe_C.", op, ": score_func='",
                std::string(score_func), "' is unknown; use 'softmax' or 'sigmoid'.");
  }
  TORCH_CHECK(E >= 1 && E <= kMaxRouterExperts, "lightning_moe_C.", op, ": E=", num(E),
              " experts; the kernel handles 1..", num(kMaxRouterExperts), " (use the torch path).");
  TORCH_CHECK(top_k >= 1 && top_k <= kMaxRouterTopK && top_k <= E, "lightning_moe_C.", op,
              ": top_k=", num(top_k), " must be in [1, min(E=", num(E), ", ", num(kMaxRouterTopK), ")].");
  if (bias.has_value()) {
    check_tensor(*bias, op, "bias", dev);
    check_dtype(*bias, op, "bias", at::kFloat);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == E, "lightning_moe_C.", op,
                ": bias has shape ", dims(bias->sizes()), "; expected [E] = [", num(E), "].");
  }
  TORCH_CHECK(num_groups >= 0 && num_groups <= kMaxRouterGroups, "lightning_moe_C.", op,
              ": num_groups=", num(num_groups), " must be in [0, ", num(kMaxRouterGroups), "] (0 = off).");
  if (num_groups > 0) {
    TORCH_CHECK(E % num_groups == 0, "lightning_moe_C.", op, ": num_groups=", num(num_groups),
                " must divide E=", num(E), ".");
    TORCH_CHECK(group_topk >= 1 && group_topk <= num_groups, "lightning_moe_C.", op,
                ": group_topk=", num(group_topk), " must be in [1, num_groups=", num(num_groups), "].");
    TORCH_CHECK(top_k >= group_topk && top_k <= group_topk * (E / num_groups),
                "lightning_moe_C.", op, ": top_k=", num(top_k), " must be in [group_topk=",
                num(group_topk), ", group_topk * E / num_groups=", num(group_topk * (E / num_groups)),
                "] so that every kept group contributes and enough experts stay selectable.");
  }
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor ids = at::empty({T, top_k}, logits.options().dtype(at::kLong));  // the router's id dtype: no conversion after
  at::Tensor weights = at::empty({T, top_k}, logits.options());
  check_launch(router_topk(logits.data_ptr<float>(),
                           bias.has_value() ? bias->data_ptr<float>() : nullptr, T, E, top_k, sf,
                           pre_softmax, norm_topk_prob, static_cast<float>(scaling_factor),
                           num_groups, group_topk, ids.data_ptr<int64_t>(),
                           weights.data_ptr<float>(), current_stream()),
               op);
  return {ids, weights};
}

// logits[T, E] fp32 = x[T, H] @ w[E, H]^T (x and w both bf16 or both fp16).
at::Tensor router_logits_op(const at::Tensor& x, const at::Tensor& w, int64_t tile_tokens) {
  constexpr const char* op = "router_logits";
  const at::Device dev = x.device();
  check_tensor(x, op, "x", dev);
  check_tensor(w, op, "w", dev);
  check_dim(x, op, "x", 2, "[T, H]");
  check_dim(w, op, "w", 2, "[E, H]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
              "lightning_moe_C.", op, ": x.dtype=", x.scalar_type(), " and w.dtype=", w.scalar_type(),
              " must both be bfloat16 or both float16 (use the torch path otherwise).");
  TORCH_CHECK(w.size(1) == x.size(1), "lightning_moe_C.", op, ": x has shape ", dims(x.sizes()), " and w ",
              dims(w.sizes()), "; their hidden sizes must agree.");
  TORCH_CHECK(x.size(1) % 8 == 0, "lightning_moe_C.", op, ": hidden size H=", num(x.size(1)),
              " must be a multiple of 8 (16-byte row chunks; use the torch path).");
  for (const at::Tensor* t : {&x, &w}) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, "lightning_moe_C.", op,
                ": an input's data is not 16-byte aligned (a view at an odd offset); pass a fresh copy.");
  }
  TORCH_CHECK(tile_tokens == 0 || tile_tokens == 64 || tile_tokens == 128, "lightning_moe_C.", op,
              ": tile_tokens=", num(tile_tokens), " must be 0 (default), 64 or 128.");
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor logits = at::empty({x.size(0), w.size(0)}, x.options().dtype(at::kFloat));
  check_launch(router_logits(x.data_ptr(), w.data_ptr(), logits.data_ptr<float>(), x.size(0), x.size(1), w.size(0),
                             activation_dtype(x, op, "x"), static_cast<int>(tile_tokens), current_stream()),
               op);
  return logits;
}

// The router and the permutation of one dropless MoE layer in one call (the host's whole path to
// the expert rows: four launches' worth of Python and dispatcher overhead saved right where the
// device waits for the host): logits = x @ w^T (router_logits), the top-k ids (router_topk), the
// expert permutation of those ids (build_permutation) and x's rows in expert order (scatter_rows).
// Same checks, same kernels and same results as the four ops called one after the other.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_op(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t top_k,
    c10::string_view score_func, bool pre_softmax, bool norm_topk_prob, double scaling_factor, int64_t num_groups,
    int64_t group_topk) {
  at::Tensor logits = router_logits_op(x, w, 0);
  auto [ids, weights] = router_topk_op(logits, bias, top_k, score_func, pre_softmax, norm_topk_prob, scaling_factor,
                                       num_groups, group_topk);
  (void)weights;  // the differentiable weights are computed from the logits by the caller
  auto [src_idx, slot_row, counts, offsets] = build_permutation_op(ids, w.size(0));
  at::Tensor rows = scatter_rows_op(x, slot_row, ids.numel());
  return {logits, ids, src_idx, slot_row, counts, offsets, rows};
}

// ---- FP8 quantization (fp8_quant.cu) ---------------------------------------------------------

// "e4m3" / "e5m2" -> (format, torch dtype of the data).
std::tuple<Fp8Format, at::ScalarType> fp8_format(c10::string_view fmt, const char* op) {
  if (fmt == "e4m3") return {Fp8Format::kE4M3, at::kFloat8_e4m3fn};
  TORCH_CHECK(fmt == "e5m2", "lightning_moe_C.", op, ": fmt='", std::string(fmt),
              "' is not an FP8 format; use 'e4m3' or 'e5m2'.");
  return {Fp8Format::kE5M2, at::kFloat8_e5m2};
}

// (data [R, W] fp8, scale [R, U] fp32) for rows of width W: U = ceil(W / 128) blockwise, else 1.
// A row of width 0 has no blockwise units and one rowwise unit of scale 1 (an amax of 0).
std::tuple<at::Tensor, at::Tensor> fp8_outputs(const at::Tensor& like, int64_t rows, int64_t width,
                                               at::ScalarType fp8, bool blockwise) {
  at::Tensor data = at::empty({rows, width}, like.options().dtype(fp8));
  const int64_t units = blockwise ? (width + 127) / 128 : 1;
  at::Tensor scale = width == 0 ? at::ones({rows, units}, like.options().dtype(at::kFloat))
                                : at::empty({rows, units}, like.options().dtype(at::kFloat));
  return {data, scale};
}

// (data, scale) of x's rows (gathered by src_idx when given: row r = x[src_idx[r]], -1 a zero row).
std::tuple<at::Tensor, at::Tensor> quantize_rows_fp8_op(const at::Tensor& x,
                                                        const std::optional<at::Tensor>& src_idx,
                                                        c10::string_view fmt, bool blockwise, bool pow2_scales) {
  constexpr const char* op = "quantize_rows_fp8";
  const at::Device dev = x.device();
  check_tensor(x, op, "x", dev);
  check_dim(x, op, "x", 2, "[S, H]");
  const DType dt = activation_dtype(x, op, "x");
  const auto [format, fp8] = fp8_format(fmt, op);
  int64_t rows = x.size(0);
  if (src_idx.has_value()) {
    check_tensor(*src_idx, op, "src_idx", dev);
    check_dim(*src_idx, op, "src_idx", 1, "[R]");
    check_dtype(*src_idx, op, "src_idx", at::kInt);
    rows = src_idx->size(0);
    TORCH_CHECK(x.size(0) <= kInt32Max, "lightning_moe_C.", op, ": x has ", num(x.size(0)),
                " rows; int32 row indices address at most ", num(kInt32Max), ".");
  }
  const c10::cuda::CUDAGuard guard(dev);
  auto [data, scale] = fp8_outputs(x, rows, x.size(1), fp8, blockwise);
  check_launch(quantize_rows_fp8(x.data_ptr(), src_idx.has_value() ? src_idx->data_ptr<int32_t>() : nullptr,
                                 data.data_ptr(), scale.data_ptr<float>(), rows, x.size(0), x.size(1), format,
                                 blockwise, pow2_scales, dt, current_stream()),
               op);
  return {data, scale};
}

// (data, scale) of a = silu(h[:, :F]) * h[:, F:] * w[:, None] (weighted_swiglu_fwd's values).
std::tuple<at::Tensor, at::Tensor> swiglu_quantize_fp8_op(const at::Tensor& h, const std::optional<at::Tensor>& w,
                                                          c10::string_view fmt, bool blockwise, bool pow2_scales) {
  constexpr const char* op = "swiglu_quantize_fp8";
  const at::Device dev = h.device();
  check_tensor(h, op, "h", dev);
  check_dim(h, op, "h", 2, "[R, 2F]");
  TORCH_CHECK(h.size(1) % 2 == 0, "lightning_moe_C.", op, ": h has ", num(h.size(1)),
              " columns; expected an even 2F = [gate | up].");
  const DType dt = activation_dtype(h, op, "h");
  const auto [format, fp8] = fp8_format(fmt, op);
  const int64_t R = h.size(0), F = h.size(1) / 2;
  if (w.has_value()) {
    check_tensor(*w, op, "w", dev);
    check_dtype(*w, op, "w", at::kFloat);
    TORCH_CHECK(w->dim() == 1 && w->size(0) == R, "lightning_moe_C.", op, ": w has shape ",
                dims(w->sizes()), "; expected [R] = [", num(R), "].");
  }
  const c10::cuda::CUDAGuard guard(dev);
  auto [data, scale] = fp8_outputs(h, R, F, fp8, blockwise);
  check_launch(swiglu_quantize_fp8(h.data_ptr(), w.has_value() ? w->data_ptr<float>() : nullptr, data.data_ptr(),
                                   scale.data_ptr<float>(), R, F, format, blockwise, pow2_scales, dt,
                                   current_stream()),
               op);
  return {data, scale};
}

}  // namespace
}  // namespace lightning_moe

// Schemas: the Python-visible contract (torch.ops.lightning_moe_C.<name>). Outputs are always
// allocated here; no op mutates an input.
TORCH_LIBRARY(lightning_moe_C, m) {
  m.def("permute_rows(Tensor x, Tensor src_idx, Tensor? row_scale=None) -> Tensor");
  m.def("scatter_rows(Tensor x, Tensor slot_row, int num_rows) -> Tensor");
  m.def("unpermute_sum(Tensor y, Tensor slot_row, Tensor? weights=None) -> Tensor");
  m.def("unpermute_weight_grad(Tensor grad_out, Tensor y, Tensor slot_row) -> Tensor");
  m.def("weighted_swiglu_fwd(Tensor h, Tensor? w=None) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool backward=False) -> Tensor");
  m.def("qk_norm_rope_fwd(Tensor x, Tensor w, Tensor cos, Tensor sin, float eps) -> (Tensor, Tensor)");
  m.def("qk_norm_rope_bwd(Tensor x, Tensor w, Tensor cos, Tensor sin, Tensor rstd, Tensor g) -> (Tensor, Tensor)");
  m.def("cross_entropy_fwd(Tensor x, Tensor labels, int ignore_index) -> (Tensor, Tensor)");
  m.def("cross_entropy_bwd(Tensor x, Tensor labels, Tensor lse, Tensor grad_loss, int ignore_index) -> Tensor");
  m.def(
      "weighted_swiglu_bwd(Tensor h, Tensor? w, Tensor grad_a, bool need_grad_w) "
      "-> (Tensor, Tensor?)");
  m.def(
      "build_permutation(Tensor topk_ids, int num_experts) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "router_topk(Tensor logits, Tensor? bias, int top_k, str score_func, bool pre_softmax, "
      "bool norm_topk_prob, float scaling_factor, int num_groups, int group_topk) "
      "-> (Tensor, Tensor)");
  m.def("router_logits(Tensor x, Tensor w, int tile_tokens=0) -> Tensor");
  m.def(
      "route(Tensor x, Tensor w, Tensor? bias, int top_k, str score_func, bool pre_softmax, "
      "bool norm_topk_prob, float scaling_factor, int num_groups, int group_topk) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "quantize_rows_fp8(Tensor x, Tensor? src_idx, str fmt, bool blockwise, bool pow2_scales) "
      "-> (Tensor, Tensor)");
  m.def(
      "swiglu_quantize_fp8(Tensor h, Tensor? w, str fmt, bool blockwise, bool pow2_scales) "
      "-> (Tensor, Tensor)");
}

// The CUDA kernels. The same functions are registered for CPU only so that a call with CPU
// tensors fails in check_tensor with a message naming the argument and the fix, instead of the
// dispatcher's generic "Could not run ... with arguments from the 'CPU' backend".
#define LMOE_REGISTER_OPS(m)                                                    \
  m.impl("permute_rows", &lightning_moe::permute_rows_op);                      \
  m.impl("scatter_rows", &lightning_moe::scatter_rows_op);                      \
  m.impl("unpermute_sum", &lightning_moe::unpermute_sum_op);                    \
  m.impl("unpermute_weight_grad", &lightning_moe::unpermute_weight_grad_op);    \
  m.impl("weighted_swiglu_fwd", &lightning_moe::weighted_swiglu_fwd_op);        \
  m.impl("weighted_swiglu_bwd", &lightning_moe::weighted_swiglu_bwd_op);        \
  m.impl("rope", &lightning_moe::rope_op);                                      \
  m.impl("qk_norm_rope_fwd", &lightning_moe::qk_norm_rope_fwd_op);            \
  m.impl("qk_norm_rope_bwd", &lightning_moe::qk_norm_rope_bwd_op);            \
  m.impl("cross_entropy_fwd", &lightning_moe::cross_entropy_fwd_op);          \
  m.impl("cross_entropy_bwd", &lightning_moe::cross_entropy_bwd_op);          \
  m.impl("build_permutation", &lightning_moe::build_permutation_op);            \
  m.impl("router_topk", &lightning_moe::router_topk_op);                        \
  m.impl("router_logits", &lightning_moe::router_logits_op);                    \
  m.impl("route", &lightning_moe::route_op);                                    \
  m.impl("quantize_rows_fp8", &lightning_moe::quantize_rows_fp8_op);            \
  m.impl("swiglu_quantize_fp8", &lightning_moe::swiglu_quantize_fp8_op)

TORCH_LIBRARY_IMPL(lightning_moe_C, CUDA, m) { LMOE_REGISTER_OPS(m); }
TORCH_LIBRARY_IMPL(lightning_moe_C, CPU, m) { LMOE_REGISTER_OPS(m); }

#undef LMOE_REGISTER_OPS
