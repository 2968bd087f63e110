"""The expert-math options (router bias, expert biases, scaled/clamped SwiGLU) on CUDA.

A non-plain activation runs the torch SwiGLU instead of the csrc kernel, and a router bias the
separate router and permutation instead of the fused route-and-permute call; the biases are added
around whichever grouped GEMM runs. Checked against the CPU layer on the same weights (that one is
checked against plain loops in ``tests/unit/test_expert_math_options.py``): output and every
gradient, fp32 and bf16, on the fused local path and the dispatch → experts → combine path; and a
swapped gpt-oss equals HF on CUDA.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the csrc kernels run only there)", allow_module_level=True)

from lightning_moe import MoEConfig, MoELayer  # noqa: E402

DEV = torch.device("cuda")


def _config(**changes: object) -> MoEConfig:
    base = dict(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2, router_bias=True, expert_mlp_bias=True,
                swiglu_alpha=1.702, swiglu_limit=0.6, swiglu_up_offset=1.0, aux_loss="none")  # fmt: skip
    return MoEConfig(**{**base, **changes})  # type: ignore[arg-type]


def _layers(fused: bool, dtype: torch.dtype) -> tuple[MoELayer, MoELayer]:
    torch.manual_seed(0)
    cpu = MoELayer(_config(memory_efficient_permute=fused, experts_backend="loop"))
    with torch.no_grad():
        for p in cpu.parameters():
            p.normal_(0.0, 0.3)
    gpu = MoELayer(_config(memory_efficient_permute=fused)).to(DEV)
    gpu.load_state_dict(cpu.state_dict())
    return cpu.to(dtype), gpu.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_local_path", "dispatch_experts_combine"])
def test_cuda_layer_with_the_options_equals_cpu(fused: bool, dtype: torch.dtype) -> None:
    cpu, gpu = _layers(fused, dtype)
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    grad = torch.randn(512, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert gpu.router.route_and_permute(x.to(DEV)) is None  # a router bias: the separate calls run
    x_cpu, x_gpu = x.clone().requires_grad_(True), x.to(DEV).requires_grad_(True)
    y_cpu, y_gpu = cpu(x_cpu), gpu(x_gpu)
    y_cpu.backward(grad)
    y_gpu.backward(grad.to(DEV))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y_gpu.float().cpu(), y_cpu.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(x_gpu.grad.float().cpu(), x_cpu.grad.float(), atol=tol, rtol=tol)
    gpu_params = dict(gpu.named_parameters())
    for name, p in cpu.named_parameters():
        # bf16 weight gradients sum 512 tokens' products in another order on each device: the floor is
        # relative to the gradient's scale, not to each element (one element of ~1.4 differed by 10 ulps).
        atol = tol if dtype == torch.float32 else tol * float(p.grad.float().abs().max())
        torch.testing.assert_close(gpu_params[name].grad.float().cpu(), p.grad.float(), atol=atol, rtol=tol,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


def test_swapped_gpt_oss_equals_hf_on_cuda() -> None:
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_hf_families import _ids, hf_model

    from lightning_moe.models.hf import swap_moe_blocks

    ref = hf_model("gpt_oss").to(DEV).train()
    ours = swap_moe_blocks(copy.deepcopy(ref)).train()
    ids = _ids().to(DEV)
    ref_out, our_out = ref(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    torch.testing.assert_close(our_out.logits, ref_out.logits, atol=1e-4, rtol=1e-4)
    ref_out.loss.backward()
    our_out.loss.backward()
    block, layer = ref.model.layers[0].mlp, ours.model.layers[0].mlp
    torch.testing.assert_close(layer.router.bias.grad, block.router.bias.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer.experts.b2.grad, block.experts.down_proj_bias.grad, atol=1e-4, rtol=1e-4)
