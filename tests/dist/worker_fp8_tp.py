"""Worker of test_dist_fp8_tp.py: FP8 dense layers under tensor parallelism equal one process.

Two gloo ranks shard a column-parallel and a row-parallel ``Fp8Linear`` (blockwise recipe, shard
sizes multiples of 128, so every scaling unit lies inside one shard) with torch's
``ColwiseParallel`` / ``RowwiseParallel``; the output and the input and weight gradients equal the
same layers on one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_moe.config import Fp8Config
from lightning_moe.models.fp8_dense import convert_linears_to_fp8
from lightning_moe.ops.fp8.linear import Fp8Linear


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 256, bias=False))
    convert_linears_to_fp8(mlp, "on", Fp8Config(recipe="blockwise", backend="emulate"))
    assert all(isinstance(m, Fp8Linear) for m in mlp)
    return mlp


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(24, 256, generator=g), torch.randn(24, 256, generator=g)
    ref = _mlp()
    x_ref = x.clone().requires_grad_(True)
    ref(x_ref).backward(dy)  # a fixed upstream gradient: quantization would amplify rounding-order noise in one

    tp = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    x_tp = x.clone().requires_grad_(True)
    y = tp(x_tp)
    y.backward(dy)
    torch.testing.assert_close(_full(y), ref(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_tp.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(tp.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.grad), q.grad, rtol=1e-5, atol=1e-5, msg=name)
    if dist.get_rank() == 0:
        print("OK fp8 dense tp=2", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
