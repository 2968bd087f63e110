"""Gradient-accumulation fusion of the expert weight gradients (ops/wgrad/), on CPU.

Every case compares against the same layer with the fusion off: equal gradients after several
accumulated backward passes, and the in-place path taken exactly when the engine would have added
into ``.grad`` itself (never for ``autograd.grad``, hooks, ``create_graph`` or partial ``inputs``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lightning_moe.ops.wgrad as wacc
import lightning_moe.ops.wgrad.choice as wchoice
from lightning_moe import MoEConfig, MoELayer
from lightning_moe.config import KernelConfig
from lightning_moe.ops.wgrad import HostOffsets, fusion_pays
from lightning_moe.ops.wgrad import cutlass_kernel as wgrad_cutlass


def _layer(fuse: bool, backend: str = "torch", num_experts: int = 8, **kw: Any) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(
        hidden_size=16, ffn_hidden_size=8, num_experts=num_experts, top_k=2, pre_softmax=True,
        aux_loss="none", experts_backend=backend, fuse_wgrad_accumulation=fuse, **kw,
    )  # fmt: skip
    return MoELayer(cfg)


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the tiny test shapes count as wide, and count the in-place accumulations."""
    monkeypatch.setattr(wchoice, "wide_experts", lambda w2: True)
    calls: list[int] = []
    original = wacc.WgradFusion.accumulate_

    def spy(self: wacc.WgradFusion, grad: torch.Tensor, *args: Any) -> None:
        assert not self.grouped  # CPU: the per-expert loop
        calls.append(grad.shape[0])
        original(self, grad, *args)

    monkeypatch.setattr(wacc.WgradFusion, "accumulate_", spy)
    return calls


def _steps(layer: MoELayer, steps: int, tokens: int = 24, **backward: Any) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(tokens, 16, generator=g)
        layer(x).pow(2).sum().backward(**backward)
    return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_accumulated_gradients_equal_the_unfused_layer(backend: str, fused_calls: list[int]) -> None:
    reference = _steps(_layer(False, backend), steps=3)
    assert fused_calls == []  # off by default: nothing fused
    fused = _steps(_layer(True, backend), steps=3)
    _assert_close(fused, reference)
    # first backward: no .grad yet, autograd keeps the returned one; then w2 and w13 in place, twice
    assert fused_calls == [8, 8, 8, 8]


def test_experts_without_rows_keep_their_gradient(fused_calls: list[int]) -> None:
    reference = _steps(_layer(False, num_experts=64), steps=2, tokens=5)  # 10 slots over 64 experts
    fused = _steps(_layer(True, num_experts=64), steps=2, tokens=5)
    _assert_close(fused, reference)
    assert fused_calls == [64, 64]


def test_autograd_grad_is_answered_and_leaves_dot_grad_alone(fused_calls: list[int]) -> None:
    layer = _layer(True)
    _steps(layer, steps=1)
    before = {n: p.grad.clone() for n, p in layer.named_parameters()}
    x = torch.randn(24, 16, requires_grad=True)
    w13 = layer.experts.w13
    g_x, g_w13 = torch.autograd.grad(layer(x).pow(2).sum(), [x, w13])
    reference_layer = _layer(False)
    expected = torch.autograd.grad(reference_layer(x).pow(2).sum(), [x, reference_layer.experts.w13])
    torch.testing.assert_close(g_x, expected[0])
    torch.testing.assert_close(g_w13, expected[1])
    _assert_close({n: p.grad for n, p in layer.named_parameters()}, before)
    assert fused_calls == []


def test_backward_with_inputs_that_exclude_the_experts_leaves_their_grad(fused_calls: list[int]) -> None:
    layer = _layer(True)
    _steps(layer, steps=1)
    w13_grad = layer.experts.w13.grad.clone()
    router = layer.router.weight
    _steps(layer, steps=1, inputs=[router])
    torch.testing.assert_close(layer.experts.w13.grad, w13_grad, rtol=0, atol=0)
    assert fused_calls == []


def test_hooks_on_the_weights_see_every_gradient(fused_calls: list[int]) -> None:
    seen: list[str] = []

    def run(fuse: bool) -> dict[str, torch.Tensor]:
        layer = _layer(fuse)
        layer.experts.w13.register_hook(lambda g: g * 2)  # a tensor hook changes the gradient
        layer.experts.w2.register_post_accumulate_grad_hook(lambda p: seen.append("w2"))
        return _steps(layer, steps=2)

    _assert_close(run(True), run(False))
    assert seen == ["w2"] * 4  # every backward, both runs
    assert fused_calls == []  # hooks watch both weights: nothing fused


def test_create_graph_is_not_fused(fused_calls: list[int]) -> None:
    layer = _layer(True)
    _steps(layer, steps=1)
    for p in layer.parameters():
        p.grad = p.grad.detach()
    x = torch.randn(24, 16)
    layer(x).pow(2).sum().backward(create_graph=True)
    assert fused_calls == []
    for p in layer.parameters():  # break the graph<->grad cycle create_graph makes
        p.grad = None


def test_a_strided_grad_is_added_by_autograd(fused_calls: list[int]) -> None:
    reference = _steps(_layer(False), steps=2)
    layer = _layer(True)
    _steps(layer, steps=1)
    grad = layer.experts.w13.grad
    layer.experts.w13.grad = grad.transpose(1, 2).contiguous().transpose(1, 2)  # same values, not contiguous
    g = torch.Generator().manual_seed(3)
    torch.randn(24, 16, generator=g)  # the second step's input, as in _steps
    layer(torch.randn(24, 16, generator=g)).pow(2).sum().backward()
    _assert_close({n: p.grad for n, p in layer.named_parameters()}, reference)
    assert fused_calls == [8]  # w2 only


def test_fusion_pays_for_wide_experts_only() -> None:
    assert fusion_pays(7168, 2048, 2)  # DeepSeek-V3
    assert fusion_pays(4096, 14336, 2)  # Mixtral-8x7B
    assert not fusion_pays(2048, 768, 2)  # Qwen3-30B-A3B
    assert not _layer(True).experts.w13.shape[-1] > 1024  # the test shapes need the fixture to count


def test_host_offsets_give_the_bounds() -> None:
    offs = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    assert HostOffsets(offs).bounds() == [0, 0, 3, 3, 7]


def test_config_flag_reaches_the_experts() -> None:
    assert _layer(True).experts.fuse_wgrad_accumulation
    assert not _layer(False).experts.fuse_wgrad_accumulation


@pytest.mark.parametrize("strategy", ["auto", "folded_moe"])
def test_trainer_with_gradient_accumulation_trains_like_the_unfused_model(
    strategy: str, fused_calls: list[int], tmp_path: Any
) -> None:
    """Lightning's accumulate_grad_batches: micro-batches 2..N add into .grad through the GEMMs."""
    import lightning_moe  # noqa: F401  (registers folded_moe)
    from _callback_models import tiny_config, tiny_trainer, token_loader
    from lightning_moe.lit import MoELanguageModel

    finals = []
    for fuse in (False, True):
        torch.manual_seed(0)
        module = MoELanguageModel(tiny_config(fuse_wgrad_accumulation=fuse), log_layer_load=False)
        trainer = tiny_trainer(tmp_path / str(fuse), [], max_steps=2, accumulate_grad_batches=3, strategy=strategy)
        trainer.fit(module, token_loader())
        finals.append({n: p.detach().clone() for n, p in module.named_parameters()})
    for name in finals[0]:
        torch.testing.assert_close(finals[1][name], finals[0][name], rtol=1e-4, atol=1e-6, msg=name)
    # 2 optimizer steps x 2 accumulating micro-batches x 2 layers x (w2, w13)
    assert len(fused_calls) == 2 * 2 * 2 * 2


def test_strategies_that_reduce_from_accumulator_hooks_are_refused(tmp_path: Any) -> None:
    from _callback_models import tiny_config, tiny_trainer, token_loader
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy
    from lightning_moe.lit import MoELanguageModel, check_wgrad_fusion

    fused = MoELanguageModel(tiny_config(fuse_wgrad_accumulation=True), log_layer_load=False)
    for strategy in (DDPStrategy, FSDPStrategy, DeepSpeedStrategy):
        with pytest.raises(ValueError, match=f"fuse_wgrad_accumulation=True.*under {strategy.__name__}"):
            check_wgrad_fusion(fused, strategy.__new__(strategy))
    check_wgrad_fusion(fused, SingleDeviceStrategy.__new__(SingleDeviceStrategy))  # fine
    plain = MoELanguageModel(tiny_config(), log_layer_load=False)
    check_wgrad_fusion(plain, DDPStrategy.__new__(DDPStrategy))  # nothing fused: fine
    trainer = tiny_trainer(tmp_path, [], max_steps=1, strategy="ddp")  # one CPU process: the hook runs at fit
    try:
        with pytest.raises(ValueError, match="under DDPStrategy"):
            trainer.fit(fused, token_loader())
    finally:  # the one-process gloo group DDP set up must not leak into later tests
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


OFFS, ROWS = torch.tensor([1, 2], dtype=torch.int32), torch.zeros(2, 4)


def test_on_cpu_every_kernel_runs_the_loop() -> None:
    for kernel in ("cutlass", "streams", "loop", "auto"):  # on CPU tensors: the loop, whatever is asked
        fusion = wacc.WgradFusion(OFFS, ROWS, kernel=kernel)
        assert not fusion.grouped and fusion.kernel == "loop", kernel


def test_unknown_wgrad_kernel_and_stream_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="kernel='cublaslt' is not one of"):
        wacc.WgradFusion(OFFS, ROWS, kernel="cublaslt")
    with pytest.raises(ValueError, match=r"streams=\(2, 0\)"):
        wacc.WgradFusion(OFFS, ROWS, streams=(2, 0))


@pytest.mark.parametrize("kernel", ["auto", "loop", "streams"])
def test_every_wgrad_kernel_accumulates_like_autograd(kernel: str, fused_calls: list[int]) -> None:
    """The layer with KernelConfig(wgrad=kernel) (on CPU all run the loop) over 3 backward passes."""
    want = _steps(_layer(False), 3)
    got = _steps(_layer(True, kernels=KernelConfig(wgrad=kernel)), 3)
    _assert_close(got, want)
    assert len(fused_calls) == 4  # w2 and w13 of the second and third passes


def test_auto_kernel_deals_many_experts_over_two_streams() -> None:
    assert wacc.auto_kernel(256) == "streams" and wacc.auto_kernel(16) == "streams"
    assert wacc.auto_kernel(8) == "loop"  # Mixtral: eight long GEMMs leave no gaps to fill
    fusion = wacc.WgradFusion(torch.arange(1, 33, dtype=torch.int32), torch.zeros(32, 4))
    assert fusion.kernel == "loop"  # streams are CUDA's: on CPU the loop


def test_accumulation_over_no_streams_is_refused() -> None:
    with pytest.raises(ValueError, match="streams >= 1; got 0"):
        wacc.accumulate_wgrad_(torch.zeros(1, 2, 2), torch.zeros(1, 2), torch.zeros(1, 2), [0, 1], streams=0)


def test_the_configured_stream_counts_reach_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """KernelConfig(wgrad_streams_w13=3, wgrad_streams_w2=1) reaches accumulate_wgrad_ per weight."""
    import lightning_moe.ops.wgrad.fusion as wfusion

    seen: dict[tuple[int, ...], int] = {}

    def spy(grad, x, dy, bounds, streams=1):  # noqa: ANN001, ANN202
        seen[tuple(grad.shape)] = streams
        for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            grad[e] += x[lo:hi].t() @ dy[lo:hi]

    monkeypatch.setattr(wfusion, "accumulate_wgrad_", spy)
    fusion = wacc.WgradFusion(OFFS, ROWS, kernel="streams", streams=(3, 1))
    fusion.kernel = "streams"  # as on CUDA (on CPU tensors the choice is the loop)
    fusion.accumulate_(torch.zeros(2, 4, 6), torch.zeros(2, 4), torch.zeros(2, 6), "w13")
    fusion.accumulate_(torch.zeros(2, 3, 4), torch.zeros(2, 3), torch.zeros(2, 4), "w2")
    assert seen == {(2, 4, 6): 3, (2, 3, 4): 1}
    assert MoELayer(MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, kernels=KernelConfig(
        wgrad_streams_w13=3, wgrad_streams_w2=1))).experts.wgrad_streams == (3, 1)


def test_narrow_experts_fuse_only_through_the_cutlass_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """One grouped CUTLASS launch per weight pays at any width; per-expert cuBLAS GEMMs only for wide experts."""
    w13 = torch.zeros(2, 8, 6, requires_grad=True)
    w2 = torch.zeros(2, 3, 8, requires_grad=True)
    x = torch.zeros(5, 8)
    assert not fusion_pays(8, 3, 4)
    monkeypatch.setattr(wgrad_cutlass, "supported", lambda x, *weights: False)
    assert not any(wacc.may_fuse(kernel, w13, w2, x) for kernel in ("auto", "cutlass", "streams", "loop"))
    monkeypatch.setattr(wgrad_cutlass, "supported", lambda x, *weights: True)
    assert wacc.may_fuse("auto", w13, w2, x) and wacc.may_fuse("cutlass", w13, w2, x)
    assert not wacc.may_fuse("loop", w13, w2, x) and not wacc.may_fuse("streams", w13, w2, x)


def test_stream_count_on_cpu_runs_the_loop_in_place() -> None:
    grad, x, dy = torch.zeros(2, 3, 4), torch.randn(5, 3), torch.randn(5, 4)
    wacc.accumulate_wgrad_(grad, x, dy, [0, 2, 5], streams=2)
    torch.testing.assert_close(grad[0], x[:2].t() @ dy[:2])
    torch.testing.assert_close(grad[1], x[2:].t() @ dy[2:])


def test_auto_takes_the_cutlass_kernel_for_narrow_experts_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured (H200, one process): CUTLASS wins on Qwen3's narrow experts, the cuBLAS loop on DeepSeek-V3's."""
    monkeypatch.setattr(wgrad_cutlass, "supported", lambda x, *weights: True)
    narrow = (torch.empty(2, 2048, 1536, device="meta", dtype=torch.bfloat16),
              torch.empty(2, 768, 2048, device="meta", dtype=torch.bfloat16))  # Qwen3-30B-A3B: 9.4 MB an expert
    wide = (torch.empty(2, 7168, 4096, device="meta", dtype=torch.bfloat16),
            torch.empty(2, 2048, 7168, device="meta", dtype=torch.bfloat16))  # DeepSeek-V3: 88 MB
    assert wacc.WgradFusion(OFFS, ROWS, narrow).kernel == "cutlass"
    assert wacc.WgradFusion(OFFS, ROWS, wide).kernel == "loop"  # streams on CUDA; CPU tensors: one stream
    assert wacc.WgradFusion(OFFS, ROWS, wide, kernel="cutlass").kernel == "cutlass"  # asked for: any width
    monkeypatch.setattr(wgrad_cutlass, "supported", lambda x, *weights: False)
    assert wacc.WgradFusion(OFFS, ROWS, narrow).kernel == "loop"  # unavailable: the cuBLAS path


def test_the_configured_wgrad_kernel_reaches_the_fusion(monkeypatch: pytest.MonkeyPatch) -> None:
    """KernelConfig(wgrad=...) is handed, as a plain string, to the fusion the layer builds."""
    import lightning_moe.ops.local_experts as local_ops

    asked: list[str] = []
    real = local_ops.WgradFusion

    def spy(offs, x, weights, kernel, streams):  # noqa: ANN001, ANN202
        asked.append(kernel)
        return real(offs, x, weights, kernel, streams)

    monkeypatch.setattr(local_ops, "WgradFusion", spy)
    monkeypatch.setattr(wchoice, "wide_experts", lambda w2: True)
    _steps(_layer(True, kernels=KernelConfig(wgrad="streams")), 2)
    assert asked and set(asked) == {"streams"}


def test_accumulation_adds_each_experts_product_and_ignores_rows_past_the_last_offset() -> None:
    # bounds [0, 2, 2, 5]: expert 1 has no rows; rows 5 and 6 are padding past offs[-1].
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 3, 4, generator=g)
    x, dy = torch.randn(7, 3, generator=g), torch.randn(7, 4, generator=g)
    x[5:], dy[5:] = 1e3, 1e3  # padding that must not reach any gradient
    grad = old.clone()
    wacc.accumulate_wgrad_(grad, x, dy, [0, 2, 2, 5])
    torch.testing.assert_close(grad[0], old[0] + x[:2].t() @ dy[:2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad[1], old[1], atol=0, rtol=0)
    torch.testing.assert_close(grad[2], old[2] + x[2:5].t() @ dy[2:5], atol=1e-5, rtol=1e-5)
