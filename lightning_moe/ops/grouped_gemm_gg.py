"""Adapter for the optional ``grouped_gemm`` package (``pip install lightning-moe[grouped_gemm]``).

Imported only when ``experts_backend='grouped_gemm'`` is asked for. Its ``gmm`` takes per-expert
row counts on the host, so each call syncs once.
"""

from __future__ import annotations

from importlib.util import find_spec

import torch

__all__ = ["require_grouped_gemm", "gg_gmm", "gg_wgrad"]


def require_grouped_gemm() -> None:
    if find_spec("grouped_gemm") is None:
        raise ModuleNotFoundError(
            "experts_backend='grouped_gemm' needs the grouped_gemm package: pip install 'lightning-moe[grouped_gemm]'."
        )


def _counts(offs_E: torch.Tensor) -> torch.Tensor:
    offs = offs_E.long().cpu()  # SYNC: grouped_gemm wants host-side batch sizes
    return torch.diff(offs, prepend=offs.new_zeros(1))


def gg_gmm(x_RD: torch.Tensor, w_EDO: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    from grouped_gemm import backend as gg_backend

    return gg_backend.gmm(x_RD, w_EDO, _counts(offs_E), trans_b=False)


def gg_wgrad(x_RD: torch.Tensor, dy_RO: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    from grouped_gemm import backend as gg_backend

    return gg_backend.gmm(x_RD, dy_RO, _counts(offs_E), trans_a=True)
