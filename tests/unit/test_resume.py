"""Exact resume: the train loader's position is checkpointed, and a killed run resumes bitwise.

The sampler/loader tests run in-process; the Trainer tests run a tiny MoE model (``_resume_run.py``)
for 16 steps over several epochs with validation every 5 steps, once uninterrupted and once
SIGKILLed after step 13 and resumed from its step-10 checkpoint (or after 16 from 14, an epoch's
last batch): every loss after the checkpoint and the
final parameters (and the router's expert bias) must be bit-for-bit those of the uninterrupted run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_moe.data import MoEDataModule, ResumableDataLoader, ResumableSampler

HERE = Path(__file__).resolve().parent


class _Range(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _loader(n: int, batch: int, replicas: int = 1, rank: int = 0, seed: int = 5) -> ResumableDataLoader:
    ds = _Range(n)
    return ResumableDataLoader(ds, ResumableSampler(ds, replicas, rank, seed=seed), batch_size=batch)


def _ids(batches: list[torch.Tensor]) -> list[int]:
    return [int(i) for b in batches for i in b]


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_sampler_order_is_distributed_samplers_for_each_rank_and_epoch(replicas: int) -> None:
    ds = _Range(23)
    for rank in range(replicas):
        ours = ResumableSampler(ds, replicas, rank, seed=4)
        ref = DistributedSampler(ds, replicas, rank, seed=4, drop_last=True)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref)


def test_loader_resumes_mid_epoch_with_the_next_unseen_batch() -> None:
    whole = list(_loader(40, 4))
    first = _loader(40, 4)
    it = iter(first)
    seen = [next(it) for _ in range(3)]
    state = first.state_dict()
    assert state["consumed"] == 12 and state["epoch"] == 0 and state["seed"] == 5
    resumed = _loader(40, 4)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert _ids(seen + rest) == _ids(whole)
    # the position is used once: the epoch after starts at its beginning, in its own order
    resumed.sampler.set_epoch(1)  # type: ignore[attr-defined]
    second = _loader(40, 4)
    second.sampler.set_epoch(1)  # type: ignore[attr-defined]
    assert _ids(list(resumed)) == _ids(list(second)) != _ids(whole)


def test_each_dp_rank_resumes_its_own_shard() -> None:
    loaders = [_loader(40, 3, 2, r) for r in range(2)]
    whole = [_ids(list(dl)) for dl in loaders]
    its = [iter(dl) for dl in loaders]
    for it in its:
        next(it), next(it)
    state = loaders[0].state_dict()
    assert state["consumed"] == 2 * 3 * 2  # global samples: batches x batch x dp ranks
    for rank in range(2):
        fresh = _loader(40, 3, 2, rank)
        fresh.load_state_dict(state)
        assert _ids(list(fresh)) == whole[rank][6:]


def test_a_new_dp_size_continues_the_global_stream() -> None:
    two = [_loader(40, 2, 2, r) for r in range(2)]
    its = [iter(dl) for dl in two]
    seen = set()
    for it in its:
        seen |= set(_ids([next(it), next(it)]))
    one = _loader(40, 2)
    one.load_state_dict(two[0].state_dict())
    rest = _ids(list(one))
    assert not seen & set(rest) and len(seen) + len(rest) == 40


def test_state_counts_batches_handed_out_not_prefetched_by_workers() -> None:
    ds = _Range(64)
    dl = ResumableDataLoader(ds, ResumableSampler(ds, seed=1), batch_size=4, num_workers=1)
    it = iter(dl)
    next(it)
    assert dl.state_dict()["consumed"] == 4
    del it


@pytest.mark.parametrize(("key", "value"), [("seed", 6), ("dataset_len", 41), ("shuffle", False)])
def test_load_state_dict_refuses_another_runs_data(key: str, value: object) -> None:
    state = _loader(40, 4).state_dict()
    with pytest.raises(ValueError, match=rf"{key}={value!r}"):
        _loader(40, 4).load_state_dict({**state, key: value})


def test_load_state_dict_names_missing_keys() -> None:
    with pytest.raises(ValueError, match="consumed"):
        _loader(40, 4).load_state_dict({"seed": 5, "epoch": 0})


def test_sampler_rejects_bad_rank() -> None:
    with pytest.raises(ValueError, match=r"rank=2 must be an int in \[0, 2\)"):
        ResumableSampler(_Range(8), num_replicas=2, rank=2)


def test_datamodule_train_loader_is_resumable() -> None:
    dm = MoEDataModule(seq_len=8, batch_size=4, max_bytes=4_000, seed=3)
    dm.setup("fit")
    dl = dm.train_dataloader()
    assert isinstance(dl, ResumableDataLoader) and dl.sampler.seed == 3  # type: ignore[attr-defined]
    it = iter(dl)
    next(it)
    assert dl.state_dict()["consumed"] == 4


# --- Trainer: killed and resumed equals uninterrupted ------------------------------------------


def _run(out: Path, mode: str, strategy: str, every: int) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    cmd = [sys.executable, str(HERE / "_resume_run.py"), str(out), mode, strategy, str(every)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


# every=5: the checkpoint at step 10 is mid-epoch (epochs of 7 batches); every=7: at step 14, the
# last batch of an epoch, so the resumed run starts the next epoch.
@pytest.mark.parametrize("every", [5, 7])
def test_sigkilled_run_resumes_bitwise_from_its_last_checkpoint(tmp_path: Path, every: int) -> None:
    strategy = "auto"  # FoldedMoEStrategy on one device cannot load its own checkpoint yet
    from _resume_run import KILL, STEPS, read_losses

    kill = KILL if every == 5 else 16
    for modes, rc in ((f"kill={kill}", -9), ("resume,full", 0)):
        job = _run(tmp_path, modes, strategy, every)
        assert job.returncode == rc, f"{modes}: rc={job.returncode}\n{job.stderr[-4000:]}"
    full, crashed = tmp_path / "full", tmp_path
    want, got = read_losses(full), read_losses(crashed)
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    diff = {s: abs(want[s] - got[s]) for s in want if want[s] != got[s]}
    assert not diff, f"losses differ after resume at steps {sorted(diff)} (max {max(diff.values()):.3g})"
    a, b = torch.load(full / "full.pt"), torch.load(crashed / "resume.pt")
    assert a.keys() == b.keys() and any(k.endswith("expert_bias") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
