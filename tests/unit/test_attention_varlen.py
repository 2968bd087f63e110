"""The ``varlen`` backend (``torch.nn.attention.varlen``) and how ``auto`` picks a backend on CUDA.

No CUDA here: torch's varlen kernel is replaced by a plain-PyTorch one with each signature torch
has shipped, and the device checks are patched; tests/gpu/test_varlen_attention_gpu.py runs the
real kernels.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch

from lightning_moe.models import attention as attention_mod
from lightning_moe.models.attention import attend, resolve_backend

from _attention_reference import DOCS, grads, inputs, per_document, reference

CUDA = torch.device("cuda")


def _reference_varlen(q_TND: torch.Tensor, k_TND: torch.Tensor, v_TND: torch.Tensor, cu: torch.Tensor,
                      scale: float | None) -> torch.Tensor:  # fmt: skip
    if scale is not None:
        q_TND = q_TND * (scale * q_TND.shape[-1] ** 0.5)
    out = torch.empty(q_TND.shape[0], q_TND.shape[1], v_TND.shape[-1], dtype=q_TND.dtype)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        out[lo:hi] = reference(*(x[lo:hi].transpose(0, 1) for x in (q_TND, k_TND, v_TND))).transpose(0, 1)
    return out


def _fake_varlen(style: str, calls: list[dict[str, object]]) -> Callable[..., torch.Tensor]:
    """A stand-in for ``varlen_attn`` with the signature of one torch release line."""

    def record(q, k, v, cu_q, cu_k, max_q, max_k, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append({"cu": cu_q.tolist(), "max": max_q, "heads": (q.shape[1], k.shape[1]), **kw})
        assert torch.equal(cu_q, cu_k) and max_q == max_k
        causal = kw.get("is_causal", False) or tuple(kw.get("window_size", (-1, -1))) == (-1, 0)
        if not causal:
            raise RuntimeError("the fake kernel computes causal attention only")
        if q.shape[1] != k.shape[1] and not kw.get("enable_gqa", False):
            raise RuntimeError(f"Hq={q.shape[1]} != Hkv={k.shape[1]} without enable_gqa")
        return _reference_varlen(q, k, v, cu_q, kw.get("scale"))

    if style == "is_causal":  # the first releases: varlen_attn(..., is_causal=False, return_aux=None)

        def fn(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, return_aux=None, scale=None):  # noqa: ANN001, ANN202
            return record(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=is_causal, scale=scale)

    elif style == "window_size":  # window_size=(-1, 0) for causal, no enable_gqa

        def fn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):  # noqa: ANN001, ANN202
            return record(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window_size, scale=scale)

    else:  # window_size and enable_gqa

        def fn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),  # noqa: ANN001, ANN202
               enable_gqa=False):  # fmt: skip
            return record(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window_size, scale=scale, enable_gqa=enable_gqa)

    return fn


def _available(monkeypatch: pytest.MonkeyPatch, *, flash_attn: bool, torch_varlen: bool, capable: bool = True,
               flex: bool = True) -> None:  # fmt: skip
    """Pretend these kernels import (and the GPU can run torch's flash kernel)."""
    monkeypatch.setattr(attention_mod, "_flash_varlen_fn", lambda: (lambda *a, **k: None) if flash_attn else None)
    fake = _fake_varlen("enable_gqa", [])
    monkeypatch.setattr(attention_mod, "_torch_varlen_fn", lambda: fake if torch_varlen else None)
    monkeypatch.setattr(attention_mod, "_cuda_flash_capable", lambda device: capable)
    monkeypatch.setattr(attention_mod, "_flex_fn", lambda device: (lambda *a, **k: None) if flex else None)


@pytest.mark.parametrize("style", ["is_causal", "window_size", "enable_gqa"])
def test_torch_varlen_layout_equals_each_document_alone(monkeypatch: pytest.MonkeyPatch, style: str) -> None:
    """Flattened rows, one sequence per document, causal and GQA asked for the way that torch takes them."""
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(attention_mod, "_torch_varlen_fn", lambda: _fake_varlen(style, calls))
    q, k, v, c = inputs(3)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention_mod._attend_varlen(q, k, v, DOCS, None, "varlen", attention_mod._torch_varlen_kernel)

    got = grads(run, q, k, v, c)
    want = grads(lambda q, k, v: per_document(q, k, v, DOCS), q, k, v, c)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    call = calls[0]
    assert call["cu"] == [0, 4, 5, 11, 13, 26] and call["max"] == 13
    assert call["heads"] == ((4, 2) if style == "enable_gqa" else (4, 4))  # repeated where no enable_gqa
    assert call.get("enable_gqa", True) and call.get("is_causal", True)
    assert tuple(call.get("window_size", (-1, 0))) == (-1, 0)


def test_torch_varlen_passes_the_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(attention_mod, "_torch_varlen_fn", lambda: _fake_varlen("enable_gqa", calls))
    q, k, v, _ = inputs(4)
    got = attention_mod._attend_varlen(q, k, v, DOCS, 0.5, "varlen", attention_mod._torch_varlen_kernel)
    want = per_document(q * (0.5 * q.shape[-1] ** 0.5), k, v, DOCS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls[0]["scale"] == 0.5


def test_the_installed_torch_varlen_signature_is_understood() -> None:
    fn = attention_mod._torch_varlen_fn()
    if fn is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    style = attention_mod._varlen_call_style(fn)
    params = inspect.signature(fn).parameters
    assert style is not None and style[0] in params and style[1] == ("enable_gqa" in params)


def test_the_installed_torch_varlen_wrapper_gets_a_causal_gqa_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch's own ``varlen_attn`` (its argument handling), with the CUDA op under it replaced:
    the op must be asked for causal attention, with GQA heads or repeated ones."""
    fn = attention_mod._torch_varlen_fn()
    if fn is None or not hasattr(torch.ops, "torch_attn"):
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    calls: list[tuple[bool, tuple[object, ...], int]] = []

    def op(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None, window_size=None, *rest):  # noqa: ANN001, ANN002, ANN202
        calls.append((is_causal, rest, k.shape[1]))
        lse = torch.zeros(q.shape[1], q.shape[0])
        return _reference_varlen(q, k, v, cu_q, scale), lse, torch.zeros(2)

    monkeypatch.setattr(torch.ops.torch_attn, "_varlen_attn", op)
    q, k, v, _ = inputs(7)
    got = attention_mod._attend_varlen(q, k, v, DOCS, None, "varlen", attention_mod._torch_varlen_kernel)
    torch.testing.assert_close(got, per_document(q, k, v, DOCS), rtol=1e-5, atol=1e-5)
    (is_causal, rest, kv_heads), = calls
    assert is_causal
    has_gqa = "enable_gqa" in inspect.signature(fn).parameters
    assert kv_heads == (2 if has_gqa else 4) and (not has_gqa or rest[0] is True)


@pytest.mark.parametrize(
    ("flash_attn", "torch_varlen", "capable", "flex", "want"),
    [
        (True, True, True, True, "flash_varlen"),
        (False, True, True, True, "varlen"),
        (False, True, False, True, "flex"),  # an older GPU: torch's flash kernel cannot run
        (False, False, True, True, "flex"),
        (False, False, True, False, "sdpa"),
    ],
)
def test_auto_on_cuda_prefers_flash_attn_then_torch_varlen_then_flex(
    monkeypatch: pytest.MonkeyPatch, flash_attn: bool, torch_varlen: bool, capable: bool, flex: bool, want: str
) -> None:
    _available(monkeypatch, flash_attn=flash_attn, torch_varlen=torch_varlen, capable=capable, flex=flex)
    assert resolve_backend("auto", CUDA, torch.bfloat16, packed=True, positioned=False, head_dim=128) == want


def test_auto_keeps_sdpa_off_cuda_and_for_rows_the_varlen_kernels_do_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    _available(monkeypatch, flash_attn=False, torch_varlen=True)
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.bfloat16, packed=True, positioned=False, head_dim=128) == "sdpa"
    assert resolve_backend("auto", CUDA, torch.bfloat16, packed=False, positioned=False, head_dim=128) == "sdpa"
    assert resolve_backend("auto", CUDA, torch.bfloat16, packed=True, positioned=True, head_dim=128) == "sdpa"
    assert resolve_backend("auto", CUDA, torch.float32, packed=True, positioned=False, head_dim=128) == "sdpa"
    pair = resolve_backend("auto", CUDA, torch.bfloat16, packed=True, positioned=False, same_tokens=False)
    assert pair == "sdpa"
    # a head dim torch's flash kernel does not take: flex
    assert resolve_backend("auto", CUDA, torch.bfloat16, packed=True, positioned=False, head_dim=512) == "flex"
    assert resolve_backend("auto", CUDA, torch.float16, packed=True, positioned=False, head_dim=100) == "flex"


def test_auto_on_cpu_runs_sdpa_with_the_real_kernels() -> None:
    q, k, v, c = inputs(5)
    got = grads(lambda q, k, v: attend(q, k, v, document_ids=DOCS, backend="auto"), q, k, v, c)
    want = grads(lambda q, k, v: per_document(q, k, v, DOCS), q, k, v, c)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_varlen_chosen_where_it_cannot_run_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, _ = inputs()
    with pytest.raises(ValueError, match=r"backend='varlen' runs on CUDA in float16/bfloat16, not on cpu"):
        attend(q, k, v, document_ids=DOCS, backend="varlen")
    _available(monkeypatch, flash_attn=False, torch_varlen=False)
    with pytest.raises(ValueError, match=r"backend='varlen' cannot run here: torch .* has no torch.nn.attention.varlen"):
        resolve_backend("varlen", CUDA, torch.bfloat16, packed=True, positioned=False)
    _available(monkeypatch, flash_attn=False, torch_varlen=True, capable=False)
    with pytest.raises(ValueError, match=r"compute capability >= 8.0; choose attention_backend='auto'"):
        resolve_backend("varlen", CUDA, torch.bfloat16, packed=True, positioned=False)
    _available(monkeypatch, flash_attn=False, torch_varlen=True)
    with pytest.raises(ValueError, match=r"head dim 320 is not a multiple of 8 up to 256"):
        resolve_backend("varlen", CUDA, torch.bfloat16, packed=True, positioned=False, head_dim=320)
    with pytest.raises(ValueError, match=r"backend='varlen' orders keys by sequence index"):
        resolve_backend("varlen", CUDA, torch.bfloat16, packed=True, positioned=True)
    with pytest.raises(ValueError, match=r"backend='varlen' needs queries and keys to be the same tokens"):
        resolve_backend("varlen", CUDA, torch.bfloat16, packed=True, positioned=False, same_tokens=False)
    assert resolve_backend("varlen", CUDA, torch.bfloat16, packed=True, positioned=False, head_dim=128) == "varlen"


def test_a_documents_pair_is_never_sent_to_a_varlen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Queries and keys with their own document ids need a mask: ``auto`` keeps sdpa for them."""
    q, k, v, _ = inputs(6)
    docs_k = DOCS.clone()
    docs_k[0, 4] = 0  # the keys' first row joins the 1-token document to the one before it
    got = attend(q, k, v, document_ids=(DOCS, docs_k), backend="auto")
    mask = attention_mod.causal_document_mask(DOCS, docs_k, torch.arange(13), torch.arange(13))
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask[:, None]
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
