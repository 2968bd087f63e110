"""Resumable data order: a seeded, sharded sampler and a loader whose position is checkpointed.

A training epoch is one permutation of the dataset, drawn from ``seed + epoch`` (the same on every
rank), cut to a multiple of the data-parallel size and dealt out round-robin: data-parallel rank
``r`` of ``R`` reads positions ``r, r + R, r + 2R, ...`` of the permutation (``DistributedSampler``'s
order, which this sampler extends). One optimizer-free view of the run is therefore a single
global stream, and a position in it is a count of samples all ranks together have consumed.

:class:`ResumableDataLoader` counts the batches its iterator has handed out (what the training loop
consumed, not what worker processes prefetched) and reports, via ``state_dict``, the epoch, the
seed and that global position. Lightning saves it in the checkpoint (its fit loop stores the
``state_dict`` of every train loader that has one) and calls ``load_state_dict`` on resume before
the first iterator is made, so the resumed epoch continues with the next unseen batch on every rank.

Memory. Below :data:`LAZY_ORDER_MIN` samples the permutation is ``torch.randperm`` (8 bytes a
sample). From there on (a corpus read from token shards can have hundreds of millions of rows) it is
a keyed Feistel permutation (``permutation.py``) computed in chunks as the iterator advances, so the
order costs constant memory; the kind is part of the loader's state, so a resumed run keeps the
kind it started with. Either way the indices are handed out chunk by chunk, never as one list.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_moe.data.permutation import feistel_permutation

__all__ = ["LAZY_ORDER_MIN", "ORDER_KINDS", "ResumableDataLoader", "ResumableSampler"]

_STATE_KEYS = ("seed", "epoch", "consumed", "shuffle", "dataset_len")
LAZY_ORDER_MIN = 1 << 20  # samples; from here on the shuffle is a Feistel permutation (module doc)
ORDER_KINDS = ("randperm", "feistel")
_INDEX_CHUNK = 1 << 16


class ResumableSampler(DistributedSampler):
    """``DistributedSampler``'s order, able to start an epoch at a global sample position.

    Being a ``DistributedSampler``, Lightning leaves it in place instead of inserting its own.

    Args:
        dataset: the map-style dataset (only its length is read).
        num_replicas: data-parallel size (from the strategy's ``distributed_sampler_kwargs``).
        rank: this process's data-parallel rank.
        shuffle: a fresh permutation each epoch (``torch.randperm`` seeded ``seed + epoch``).
        seed: the shuffling seed, identical on every rank.
    """

    def __init__(self, dataset: Dataset[Any], num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0) -> None:  # fmt: skip
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"ResumableSampler: num_replicas={num_replicas!r} must be an int >= 1; pass the DP size.")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(
                f"ResumableSampler: rank={rank!r} must be an int in [0, {num_replicas}); pass the DP rank."
            )
        # drop_last: every rank reads the same number of samples, none of them twice.
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.start = 0  # global samples of ``epoch`` already consumed; the next iterator skips them
        self.order_kind = "feistel" if len(dataset) >= LAZY_ORDER_MIN else "randperm"  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        # A saved position belongs to its epoch: moving to another one starts that epoch afresh.
        if epoch != self.epoch:
            self.start = 0
        super().set_epoch(epoch)

    def global_order(self) -> torch.Tensor:
        """This epoch's permutation, cut to ``total_size`` (a multiple of ``num_replicas``); the whole
        tensor, so for small datasets and tests (the iterator computes a Feistel order in chunks)."""
        if self.shuffle and self.order_kind == "feistel":
            positions = np.arange(self.total_size, dtype=np.int64)
            n = len(self.dataset)  # type: ignore[arg-type]
            return torch.from_numpy(feistel_permutation(positions, n, self.seed + self.epoch))
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        return order[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, 0
        order = self.global_order() if not (self.shuffle and self.order_kind == "feistel") else torch.empty(0)
        # After a change of data-parallel size ``start`` need not divide by it: every rank still
        # reads the same count, and no sample of the remaining stream twice.
        per_rank = (self.total_size - start) // self.num_replicas
        if self.shuffle and self.order_kind == "feistel":
            return self._feistel_indices(start, per_rank)
        mine = order[start + self.rank :: self.num_replicas][:per_rank]
        return (i for chunk in mine.split(_INDEX_CHUNK) for i in chunk.tolist())

    def _feistel_indices(self, start: int, per_rank: int) -> Iterator[int]:
        n, key = len(self.dataset), self.seed + self.epoch  # type: ignore[arg-type]
        for k in range(0, per_rank, _INDEX_CHUNK):
            positions = start + self.rank + self.num_replicas * np.arange(k, min(k + _INDEX_CHUNK, per_rank))
            yield from feistel_permutation(positions, n, key).tolist()


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableSampler` whose position is a checkpointable state.

    ``state_dict()`` = ``{"seed", "epoch", "consumed", "shuffle", "dataset_len", "order"}``, where
    ``consumed`` is the global number of samples (all data-parallel ranks) the current epoch's
    iterator has handed out and ``order`` the permutation's kind (a state without it, from before
    the kinds, is ``"randperm"``). ``load_state_dict`` makes the next iterator continue from there.
    Lightning calls both (it treats any train loader with these two methods as resumable).
    """

    def __init__(self, dataset: Dataset[Any], sampler: ResumableSampler, batch_size: int, num_workers: int = 0) -> None:
        if not isinstance(sampler, ResumableSampler):
            got = type(sampler).__name__
            raise TypeError(f"ResumableDataLoader: sampler={got} is not a ResumableSampler; build one over the dataset.")
        super().__init__(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=True,  # static batch shapes (CUDA graphs, compile) and an exact position
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
        )
        self._epoch_start = 0
        self._batches_out = 0
        self._counted_epoch = sampler.epoch  # the epoch the two counters above belong to

    @property
    def resumable_sampler(self) -> ResumableSampler:
        return self.sampler  # type: ignore[return-value]

    def __iter__(self) -> Iterator[Any]:
        sampler = self.resumable_sampler
        self._epoch_start, self._batches_out, self._counted_epoch = sampler.start, 0, sampler.epoch
        return self._counted(super().__iter__())

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._batches_out += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        s = self.resumable_sampler
        if s.epoch != self._counted_epoch:  # set_epoch since the last iterator: nothing of it read yet
            consumed = s.start
        else:
            consumed = self._epoch_start + self._batches_out * int(self.batch_size or 1) * s.num_replicas
        return {"seed": s.seed, "epoch": s.epoch, "consumed": consumed, "shuffle": s.shuffle,
                "dataset_len": len(s.dataset), "order": s.order_kind}  # type: ignore[arg-type]  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(f"ResumableDataLoader: state_dict lacks {missing}; pass a state saved by state_dict().")
        s = self.resumable_sampler
        n = len(s.dataset)  # type: ignore[arg-type]
        for key, now in (("seed", s.seed), ("shuffle", s.shuffle), ("dataset_len", n)):
            if state_dict[key] != now:
                raise ValueError(
                    f"ResumableDataLoader: checkpoint {key}={state_dict[key]!r} but this loader has {key}={now!r}; "
                    "resume with the data settings of the saved run (same data, seq_len, seed)."
                )
        kind = state_dict.get("order", "randperm")
        if kind not in ORDER_KINDS:
            raise ValueError(f"ResumableDataLoader: checkpoint order={kind!r} is unknown (kinds: {list(ORDER_KINDS)}); "
                             "pass a state saved by state_dict().")  # fmt: skip
        s.order_kind = kind
        s.set_epoch(int(state_dict["epoch"]))
        s.start = int(state_dict["consumed"])
        self._epoch_start, self._batches_out, self._counted_epoch = s.start, 0, s.epoch
