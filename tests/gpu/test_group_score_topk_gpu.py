"""Group-limited routing with a non-default ``group_score_topk`` on CUDA.

The fused csrc top-k scores a group by its top ``top_k // group_topk`` experts, so a router with
another ``group_score_topk`` must take the torch selection (and the layer the separate router
and permutation calls). Checked against the CPU router on the same weights (ids bitwise, output
to fp32 rounding) in bf16 and fp32; with the default rule the kernel path still equals CPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the csrc kernels run only there)", allow_module_level=True)

from lightning_moe import MoEConfig, MoELayer  # noqa: E402

DEV = torch.device("cuda")


def _config(group_score_topk: int | None, top_k: int = 4) -> MoEConfig:
    return MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=32, top_k=top_k, num_groups=8, group_topk=2,
                     group_score_topk=group_score_topk, score_func="softmax", pre_softmax=True,
                     norm_topk_prob=False, scaling_factor=1.5, aux_loss="none")  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group_score_topk", "top_k"), [(1, 4), (3, 4), (2, 4), (None, 4), (1, 3)])
def test_cuda_router_ids_equal_cpu_for_any_group_score_topk(group_score_topk, top_k, dtype) -> None:
    torch.manual_seed(0)
    layer = MoELayer(_config(group_score_topk, top_k)).to(dtype)
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    cpu = layer.router(x)
    gpu_layer = MoELayer(_config(group_score_topk, top_k)).to(DEV, dtype)
    gpu_layer.load_state_dict(layer.state_dict())
    gpu = gpu_layer.router(x.to(DEV))
    assert torch.equal(gpu.topk_ids_TK.sort(-1).values.cpu(), cpu.topk_ids_TK.sort(-1).values)
    y_cpu = layer(x).float()
    y_gpu = gpu_layer(x.to(DEV)).float().cpu()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y_gpu, y_cpu, atol=tol, rtol=tol)

