"""The whole fold equals one process: context parallel, sequence parallel, the vocab-parallel head
and packed rows, under the Trainer (``FoldedMoEStrategy``) and Fabric (``FabricFoldedMoEStrategy``).

Every layout trains 3 optimizer steps with gradient accumulation 2 and gradient clipping, fp32;
every rank's micro-batch losses, the final parameters and the logged ``train/loss`` must equal the
one-process run (``_models.reference``; packed rows and expert bias: ``worker_fold.fold_reference``)
to 1e-5.
A rank's loss is averaged over its CP group first: CP ranks hold different chunks of the same
sequences and their mean is the DP replica's loss.

W=4: CP2·DP2 with EP4; CP4 with EP2·EDP2; TP2+SP·DP2 with EP4; TP2+SP (vocab-parallel head) with
ETP2·EP2; packed rows at CP2·DP2 with EP2 and at TP2+SP·DP2 with EP2; TP2+SP·CP2 with EP4 and
the routers' expert bias (counts over the whole world); DCP checkpoints saved at
TP2·CP2 (SP on) load at TP1·CP1 and back, bit for bit; a bad sequence length and attention that
context parallel cannot wrap are refused on every rank. W=8 (slow): TP2·CP2·DP2 with EP8;
TP2+SP·CP2 with ETP2·EP4. One torchrun job per world size runs the parts of the selected tests.
"""

from __future__ import annotations

import pytest
import torch

from _harness import Suite, launch_torchrun
from _models import reference
from worker_fold import dp_size, fold_reference, parse

pytestmark = pytest.mark.dist

LAYOUTS4 = ["cp=2,ep=4", "cp=4,ep=2", "tp=2,sp=1,ep=4", "tp=2,sp=1,vp=1,ep=2,etp=2"]
PACKED4 = ["packed=1,cp=2,ep=2", "packed=1,tp=2,sp=1,ep=2", "bias=1,tp=2,sp=1,cp=2,ep=4"]
LAYOUTS8 = ["tp=2,cp=2,ep=8", "tp=2,sp=1,cp=2,ep=4,etp=2"]
PARTS4 = [f"{kind}:{spec}" for spec in LAYOUTS4 + PACKED4 for kind in ("trainer", "fabric")]
PARTS8 = [f"{kind}:{spec}" for spec in LAYOUTS8 for kind in ("trainer", "fabric")]
_BASE_S, _PART_S, _MAX_S = 90.0, 45.0, 570.0  # below pytest-timeout's 600 s


def _job(request: pytest.FixtureRequest, factory: pytest.TempPathFactory, world: int) -> Suite:
    """One ``worker_fold.py`` job with the parts of every selected test that takes this fixture."""
    name = f"fold{world}"
    parts: list[str] = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if name in getattr(item, "fixturenames", ()) and callspec is not None and "part" in callspec.params:
            if callspec.params["part"] not in parts:
                parts.append(callspec.params["part"])
    out = factory.mktemp(name)
    job = launch_torchrun("worker_fold.py", world, [str(out), *parts], timeout=min(_BASE_S + _PART_S * len(parts), _MAX_S))
    (out / "job.log").write_text(job.output)
    return Suite(out, job)


@pytest.fixture(scope="module")
def fold4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Suite:
    return _job(request, tmp_path_factory, 4)


@pytest.fixture(scope="module")
def fold8(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Suite:
    return _job(request, tmp_path_factory, 8)


def _compare(suite: Suite, part: str, world: int) -> None:
    suite.check(part)
    result = torch.load(suite.out / f"{part}.pt")
    spec = part.partition(":")[2]
    dp = dp_size(spec, world)
    flags = parse(spec)[1]
    ref_losses, ref_state = fold_reference(dp, **flags) if any(flags.values()) else reference(dp)
    for rank, (dp_rank, losses) in enumerate(result["losses"]):
        want = [row[dp_rank] for row in ref_losses]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{part} rank {rank} losses: {m}")  # fmt: skip
    assert set(result["state"]) == set(ref_state), part
    for name, want in ref_state.items():
        torch.testing.assert_close(result["state"][name], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{part} {n}: {m}")  # fmt: skip
    # the logged loss is the mean over ranks: the last micro-batch's mean over the DP shards
    last = torch.tensor(ref_losses[-1]).mean()
    torch.testing.assert_close(torch.tensor(result["logged_loss"]), last, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("part", PARTS4)
def test_fold_on_4_ranks_matches_one_process(fold4: Suite, part: str) -> None:
    _compare(fold4, part, 4)


@pytest.mark.slow
@pytest.mark.parametrize("part", PARTS8)
def test_fold_on_8_ranks_matches_one_process(fold8: Suite, part: str) -> None:
    _compare(fold8, part, 8)


@pytest.mark.parametrize("part", ["ckpt"])
def test_checkpoint_saved_at_tp2_cp2_sp_loads_bitwise_at_tp1_cp1_and_back(fold4: Suite, part: str) -> None:
    """The worker checks the parameters bit for bit after each load and the validation loss at both
    layouts; here: the part ran, and both validation losses are finite."""
    fold4.check(part)
    result = torch.load(fold4.out / "ckpt.pt")
    assert all(torch.isfinite(torch.tensor(v)) for v in result["losses"].values()), result["losses"]


@pytest.mark.parametrize("part", ["bad"])
def test_context_parallel_refuses_a_bad_length_and_unwrappable_attention_on_every_rank(fold4: Suite, part: str) -> None:
    fold4.check(part)
    messages = torch.load(fold4.out / "bad.pt")
    assert "sequence length 6 is not a multiple of 2*cp=4" in messages["length"], messages["length"]
    assert "FoldedMoEStrategy" in messages["length"], messages["length"]
    assert "'model.layers.0.extra' (MultiheadAttention)" in messages["attention"], messages["attention"]
