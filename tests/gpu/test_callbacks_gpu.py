"""GPU checks of the memory and launch callbacks: recompute, CPUOffload and CUDAGraphCapture change no number, and act.

Every test compares a run with the feature to the same run without it (same seed, same batches):
losses and gradients equal (bitwise where the feature only moves or rebuilds data), plus the
effect itself (bytes left the device, graphs replayed, no host sync in a static MoE layer).
The step-time and memory figures come from ``benchmarks/callbacks_bench.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_moe import MoEConfig, MoELayer  # noqa: E402
from lightning_moe.callbacks.cuda_graphs import CUDAGraphCapture  # noqa: E402
from lightning_moe.callbacks.offload import CPUOffload  # noqa: E402
from lightning_moe.lit import MoELanguageModel  # noqa: E402
from lightning_moe.models.transformer import MoETransformer, TransformerConfig  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
VOCAB = 512


def _cfg(recompute: list[str] | None = None, static: bool = False, backend: str = "auto") -> TransformerConfig:
    moe = MoEConfig(
        hidden_size=256,
        ffn_hidden_size=128,
        num_experts=16,
        top_k=4,
        capacity_factor=1.25 if static else None,
        pad_to_capacity=static,
        experts_backend=backend,  # type: ignore[arg-type]
    )
    return TransformerConfig(
        vocab_size=VOCAB, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, moe=moe, max_seq_len=512,
        recompute=list(recompute or []),  # type: ignore[arg-type]
    )  # fmt: skip


def _model(cfg: TransformerConfig, dtype: torch.dtype = torch.bfloat16) -> MoETransformer:
    torch.manual_seed(0)
    with torch.device(DEV):
        model = MoETransformer(cfg)
    return model.to(dtype)


def _batches(n: int, batch: int = 2, seq: int = 256) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (batch, seq + 1), generator=g).to(DEV) for _ in range(n)]


def _loss(model: MoETransformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


@dataclass
class Trained:
    losses: torch.Tensor  # on the host, one per step
    params: dict[str, torch.Tensor]  # on the host, after the last step
    attached: Any
    optimizer: torch.optim.Optimizer


def _train(
    model: MoETransformer,
    batches: list[torch.Tensor],
    setup: Callable[[MoETransformer, torch.optim.Optimizer], Any] | None = None,
    before_step: Callable[[], None] | None = None,
) -> Trained:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    attached = setup(model, opt) if setup is not None else None
    losses = []
    for tokens in batches:
        if before_step is not None:
            before_step()
        loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    return Trained(torch.stack(losses).cpu(), params, attached, opt)


def _assert_identical(a: Trained, b: Trained) -> None:
    assert torch.equal(a.losses, b.losses), (a.losses, b.losses)
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), f"parameter {name} differs"


def _resident() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # also releases blocks whose side-stream copies have finished
    return torch.cuda.memory_allocated()


def _saved_bytes_after_forward(model: MoETransformer, tokens: torch.Tensor) -> int:
    """Device bytes held at the end of forward (side-stream copies settled), then backward."""
    base = _resident()
    loss = _loss(model, tokens)
    held = _resident() - base
    loss.backward()
    return held


# --- recompute ----------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute", [["moe_act", "norm"], ["moe"], ["attn"], ["block"]], ids=lambda r: "+".join(r))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_recompute_gives_bitwise_identical_training(recompute: list[str], dtype: torch.dtype) -> None:
    backend = "auto" if dtype == torch.bfloat16 else "loop"
    batches = _batches(2)
    base = _train(_model(_cfg(backend=backend), dtype), batches)
    _assert_identical(base, _train(_model(_cfg(recompute, backend=backend), dtype), batches))


def test_moe_act_and_norm_recompute_hold_less_at_the_end_of_forward() -> None:
    tokens = _batches(1, batch=4, seq=512)[0]
    base = _saved_bytes_after_forward(_model(_cfg()), tokens)
    lean = _saved_bytes_after_forward(_model(_cfg(["moe_act", "norm"])), tokens)
    assert lean < 0.75 * base, (lean, base)


# --- CPUOffload -----------------------------------------------------------------------------------


def _offload(**kwargs: Any) -> Callable[[MoETransformer, torch.optim.Optimizer], CPUOffload]:
    def setup(model: MoETransformer, opt: torch.optim.Optimizer) -> CPUOffload:
        cb = CPUOffload(**kwargs)
        cb.attach(model, DEV, optimizers=[opt])
        return cb

    return setup


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_activation_offload_gives_bitwise_identical_training(dtype: torch.dtype) -> None:
    backend = "loop" if dtype == torch.float32 else "auto"
    batches = _batches(3)
    base = _train(_model(_cfg(backend=backend), dtype), batches)
    got = _train(_model(_cfg(backend=backend), dtype), batches, setup=_offload(min_tensor_bytes=0))
    _assert_identical(base, got)
    cb = got.attached
    assert cb.activation_offloader is not None and cb.activation_offloader.offloaded_bytes > 0
    cb.detach()


def test_activation_offload_moves_saved_tensors_off_the_device() -> None:
    tokens = _batches(1, batch=4, seq=512)[0]
    base = _saved_bytes_after_forward(_model(_cfg()), tokens)
    model = _model(_cfg())
    cb = CPUOffload(min_tensor_bytes=0)
    cb.attach(model, DEV)
    lean = _saved_bytes_after_forward(model, tokens)
    cb.detach()
    assert lean < 0.6 * base, (lean, base)


def test_activation_offload_composes_with_recompute() -> None:
    batches = _batches(2)
    base = _train(_model(_cfg()), batches)
    _assert_identical(base, _train(_model(_cfg(["moe_act", "norm"])), batches, setup=_offload(min_tensor_bytes=0)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_optimizer_state_offload_is_identical_and_frees_two_parameter_bytes(dtype: torch.dtype) -> None:
    backend = "loop" if dtype == torch.float32 else "auto"
    batches = _batches(3)
    start = _resident()
    base = _train(_model(_cfg(backend=backend), dtype), batches)
    resident_base = _resident() - start  # parameters and AdamW states on the device
    base.optimizer = base.attached = None  # type: ignore[assignment]  # frees the baseline model
    got = _train(_model(_cfg(backend=backend), dtype), batches, setup=_offload(activations=[], optimizer_states=True))
    _assert_identical(base, got)
    cb, opt = got.attached, got.optimizer
    offloader = cb.optimizer_offloaders[0]
    offloader.synchronize()
    resident_offload = _resident() - start
    param_bytes = sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"])
    assert resident_base - resident_offload >= 1.99 * param_bytes, (resident_base, resident_offload, param_bytes)
    assert offloader.state_bytes_on_device() == 0
    big = [v for s in opt.state.values() for v in s.values() if v.numel() * v.element_size() >= offloader.min_tensor_bytes]
    assert big and all(v.device.type == "cpu" and v.is_pinned() for v in big)  # smaller ones stay by design
    cb.detach()
    assert all(v.device.type == "cuda" for s in opt.state.values() for v in s.values() if v.numel() > 1)


# --- CUDAGraphCapture -----------------------------------------------------------------------------


def test_static_moe_layer_runs_without_host_sync() -> None:
    """What capture needs: forward and backward of a capacity-padded layer never sync."""
    layer = MoELayer(MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=16, top_k=4,
                               capacity_factor=1.25, pad_to_capacity=True)).to(DEV, torch.bfloat16)  # fmt: skip
    x = torch.randn(512, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()  # warm-up: kernel builds and backend choice may sync once
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _graphed_run(batches: list[torch.Tensor], cb: CUDAGraphCapture) -> Trained:
    def setup(model: MoETransformer, opt: torch.optim.Optimizer) -> CUDAGraphCapture:
        cb.attach(model, DEV, precision="bf16-true")
        return cb

    return _train(_model(_cfg(static=True)), batches, setup=setup, before_step=cb.step)


def test_cuda_graphs_match_eager_over_20_steps() -> None:
    batches = _batches(20, batch=1, seq=512)
    eager = _train(_model(_cfg(static=True)), batches)
    cb = CUDAGraphCapture(warmup_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = _graphed_run(batches, cb)
    cb.detach()
    ours = [str(w.message) for w in caught if "CUDAGraphCapture" in str(w.message)]
    assert ours == []  # nothing skipped, nothing fell back
    assert cb.last_captured == ["layers.0.attn", "layers.0.ffn", "layers.1.attn", "layers.1.ffn"]
    assert cb.replays == 4 * (20 - 3)
    a, b = eager.losses.float(), graphed.losses.float()
    exact = torch.equal(a, b)
    assert exact or (a - b).abs().max() <= 1e-3 * a.abs().max(), f"bitwise equal: {exact}; {a} vs {b}"


def test_cuda_graphs_fall_back_on_a_shape_change_with_one_warning() -> None:
    batches = _batches(5, batch=1, seq=256)
    cb = CUDAGraphCapture(warmup_steps=2)
    model = _model(_cfg(static=True))
    twin = _model(_cfg(static=True))
    cb.attach(model, DEV, precision="bf16-true")
    for tokens in batches:
        cb.step()
        _loss(model, tokens).backward()
    other = _batches(3, batch=1, seq=128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [_loss(model, t) for t in other]
    twin.load_state_dict(model.state_dict())
    expected = [_loss(twin, t) for t in other]
    cb.detach()
    shape = [w for w in caught if "shape change" in str(w.message)]
    assert len(shape) == 1
    assert all(torch.equal(x, y) for x, y in zip(losses, expected))


# --- through the Trainer --------------------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, seq: int = 128) -> None:
        g = torch.Generator().manual_seed(3)
        self.t = torch.randint(0, VOCAB, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.t)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.t[i, :-1], "labels": self.t[i, 1:]}


@pytest.mark.parametrize("which", ["offload", "graphs"])
def test_trainer_fit_with_callback(which: str, tmp_path: Any) -> None:
    cb: L.Callback = CPUOffload(optimizer_states=True) if which == "offload" else CUDAGraphCapture(warmup_steps=2)
    trainer = L.Trainer(
        accelerator="gpu", devices=1, precision="bf16-true", max_steps=6, callbacks=[cb], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(MoELanguageModel(_cfg(static=True)), DataLoader(_Tokens(), batch_size=2, drop_last=True))
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    if which == "graphs":
        assert isinstance(cb, CUDAGraphCapture) and len(cb.last_captured) == 4 and cb.replays > 0


class _QueriesTheStream(torch.nn.Module):
    """Passes the sync check but breaks a capture: querying a capturing stream is illegal."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64, device=DEV, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda.current_stream().query()
        return torch.nn.functional.dropout(self.lin(x), 0.1)


def test_failed_capture_runs_eager_and_random_ops_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_moe.callbacks.cuda_graphs as cg

    model = torch.nn.Sequential(_QueriesTheStream())
    monkeypatch.setattr(cg, "require_moe_layers", lambda *a: None)
    cb = CUDAGraphCapture(modules=["0"], warmup_steps=1)
    cb.attach(model, DEV, precision="bf16-true")
    x = torch.randn(8, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            cb.step()
            model(x).float().sum().backward()
    cb.detach()
    failed = [str(w.message) for w in caught if "capture failed" in str(w.message)]
    assert len(failed) == 1 and cb.captured == [], [str(w.message) for w in caught]
    torch.randn(4, device=DEV)  # the default generator is usable again
    assert torch.isfinite(model(x)).all()


class _TwoOutputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 96, device=DEV)
        self.b = torch.nn.Linear(96, 64, device=DEV)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.nn.functional.silu(self.a(x))
        return self.b(h) * scale, h.argmax(-1)  # a differentiable and an integer output


def test_captured_module_matches_eager_and_feeds_the_real_parameters() -> None:
    from lightning_moe.callbacks._graphed import capture_modules

    torch.manual_seed(0)
    eager, graphed_module = _TwoOutputs(), _TwoOutputs()
    graphed_module.load_state_dict(eager.state_dict())
    scale = torch.full((1,), 0.5, device=DEV)
    sample = (torch.randn(32, 64, device=DEV, requires_grad=True), scale)
    (graphed,) = capture_modules([graphed_module], [sample])
    for step in range(3):  # new inputs and accumulated gradients every step
        x = torch.randn(32, 64, device=DEV)
        xe, xg = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ye, ie = eager(xe, scale)
        yg, ig = graphed(xg, scale)
        go = torch.randn_like(ye)
        ye.backward(go)
        yg.backward(go)
        torch.testing.assert_close(yg, ye, rtol=1e-5, atol=1e-6)
        assert torch.equal(ig, ie) and not ig.requires_grad
        torch.testing.assert_close(xg.grad, xe.grad, rtol=1e-5, atol=1e-6)
        for (name, pe), pg in zip(eager.named_parameters(), graphed_module.parameters()):
            torch.testing.assert_close(pg.grad, pe.grad, rtol=1e-5, atol=1e-6, msg=f"{name} at step {step}")
        with torch.no_grad():  # an optimizer step in place: the graphs read the new values
            for pe, pg in zip(eager.parameters(), graphed_module.parameters()):
                pe -= 0.1 * pe.grad
                pg -= 0.1 * pg.grad.clone()
