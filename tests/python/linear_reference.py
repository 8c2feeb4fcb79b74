"""Shared helpers of the Linear tests (test_linear_*.py, test_grouped_linear.py,
test_nn_linear.py): the weight maker, the references and the tolerances.

References are independent of lowbit's GEMM code: the dequantized weight comes
from nvfp4_reference.dequantize (plain torch) on the checkpoint-layout
tensors, and the product is an FP32 (or FP64) matmul. Tolerances:
  * vs FP32 matmul with the dequantized weight: ||y - ref|| / ||ref|| <= 4e-3.
    The CPU kernel is exact up to the output rounding (bf16: ~1.1e-3 rms);
    the CUDA kernels add FP32 accumulation order (fused path) or a bf16
    rounding of weight * global (cuBLAS path, ~1.1e-3 more).
  * vs the unquantized BF16 Linear: cosine >= 0.99 (NVFP4 of Gaussian
    weights keeps ~9-10% RMS error per weight, cosine ~0.995).
"""

import torch
import torch.fx.experimental._config

import lowbit
import nvfp4_reference as ref
from lowbit.nn import Nvfp4Linear

REL_TOL = 4e-3


def rel_err(y, want):
    return ((y.double() - want.double()).norm() / want.double().norm()).item()


def make_weight(n, k, gen, device="cpu"):
    w = torch.randn(n, k, generator=gen) * 0.02
    q = lowbit.nvfp4_quantize(w)
    deq = ref.dequantize(q.packed, q.block_scale.view(torch.uint8), q.global_scale)
    pw, ps = lowbit.nvfp4_prepack(q.packed.to(device), q.block_scale.to(device))
    return w, q, deq, pw, ps, q.global_scale.to(device)


def reference(x, deq, bias=None):
    y = x.double() @ deq.double().T
    if bias is not None:
        y = y + bias.double()
    return y


def fp8_mode_reference(x, q, bias=None):
    """The FP8 mode's rule (README.md, Formats) from the checkpoint tensors, in
    plain torch: each W row (e2m1 * block scale, global left out) and each x
    row times 448 / its amax, rounded to E4M3; the codes' products summed in
    float64 and scaled by amax_x / 448 and amax_w * global / 448."""

    def rows(v):
        amax = v.abs().amax(1)
        # 448 / amax rounded once (`448.0 / amax` would multiply by a rounded reciprocal)
        r = torch.where(amax > 0, torch.full_like(amax, 448.0) / amax, torch.zeros_like(amax))
        return (v * r[:, None]).to(torch.float8_e4m3fn).double(), amax

    w = ref.dequantize(q.packed, q.block_scale.view(torch.uint8), torch.ones(()))
    w8, w_amax = rows(w)
    x8, x_amax = rows(x.reshape(-1, x.shape[-1]).float())
    w_scale = (w_amax * q.global_scale.float()) / 448.0
    y = (x8 @ w8.T) * (x_amax / 448.0).double()[:, None] * w_scale.double()[None, :]
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], -1)


# Extra error of the FP8 mode against the W4A16 result (E4M3 keeps 3
# mantissa bits of x and of W: ~3% per element each; measured 3.9-4.1e-2 on
# Gaussian data, docs/perf/log/linear.md).
FP8_MODE_TOL = 6e-2


def check_k_zero(device):
    # K = 0: no products, so y is the bias (or zeros), as in F.linear.
    pw, ps = lowbit.nvfp4_prepack(torch.zeros(32, 0, dtype=torch.uint8), torch.zeros(32, 0, dtype=torch.uint8))
    pw, ps, g = pw.to(device), ps.to(device), torch.tensor(0.5, device=device)
    x = torch.randn(2, 3, 0, device=device).to(torch.bfloat16)
    bias = torch.randn(32, device=device).to(torch.bfloat16)
    assert torch.equal(lowbit.nvfp4_linear(x, pw, ps, g, bias), bias.expand(2, 3, 32))
    assert torch.equal(lowbit.nvfp4_linear(x, pw, ps, g), torch.zeros(2, 3, 32, device=device, dtype=torch.bfloat16))


def linear_grads(x, pw, ps, g, bias, grad_y, fp8_min_rows=0, fn=lowbit.nvfp4_linear):
    x = x.detach().requires_grad_()
    bias = bias.detach().requires_grad_()
    fn(x, pw, ps, g, bias, fp8_min_rows).backward(grad_y)
    return x.grad, bias.grad


class Stack(torch.nn.Module):
    # auto_rows: compute="auto" with this threshold instead of
    # AUTO_FP8_MIN_ROWS (the private setter; tests cross it at small M).
    def __init__(self, dims, device="cpu", compute="w4a16", auto_rows=None):
        super().__init__()
        layers = []
        for i in range(len(dims) - 1):
            lin = torch.nn.Linear(dims[i], dims[i + 1]).to(device=device, dtype=torch.bfloat16)
            layers.append(Nvfp4Linear.from_linear(lin, compute=compute))
            if auto_rows is not None:
                layers[-1]._set_compute("auto", auto_rows)
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


# Dynamo specializes sizes 0 and 1 unless told not to: backed_size_oblivious
# is torch's switch for that (serving stacks set it, or mark_unbacked), so
# one graph serves M = 1 too.
size_oblivious = torch.fx.experimental._config.patch(backed_size_oblivious=True)
