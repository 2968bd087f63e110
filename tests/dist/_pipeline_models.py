"""The pipeline-parallel Trainer and Fabric tests' model, data and one-process reference.

The model is ``_models``'s with 4 blocks (1 dense, 3 MoE), so it splits into 2 or 4 stages. A
batch of ``BATCH`` rows runs as ``MICRO`` micro-batches; the reference is one process that runs
the same micro-batches of each data-parallel shard one after the other: each micro-batch's
cross-entropy summed over its labelled tokens and divided by ``accum`` times the labelled tokens
of the batch over all data ranks (the token mean the product defines, whatever labels
:class:`LabelHoles` leaves out on each rank), the aux losses scaled by ``1 / (dp * accum * micro)``,
clipping (unless a spec turns it off) and the SGD step closing each optimizer step: the arithmetic
a pipeline must equal. A spec's :class:`Recipe` names what its run trains on beyond the layout.
:func:`phased_reference` runs phases of other layouts in turn (a checkpoint resumed at another
``pp`` and ``dp``), each with its data-parallel size and micro-batches, over one global sample
stream and with the module's AdamW and schedule.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from _models import ACCUM, CLIP, LR, RecordingLM, TokenData, model_config
from lightning_moe.models.transformer import TransformerConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.moe.utils import find_moe_layers, set_aux_loss_scale, update_expert_biases
from lightning_moe.optimizer import OptimizerConfig
from lightning_moe.parallel.fold_batch import IGNORE_INDEX
from lightning_moe.parallel.vocab import lm_cross_entropy

NUM_LAYERS, BATCH, MICRO = 4, 4, 4


class PackedData(TokenData):
    """``TokenData`` rows packed with documents: ``document_ids`` start a new document at random
    tokens (the same on every rank), so attention stays inside each document and RoPE positions
    restart with it. Every token keeps its label (the batches' token counts stay equal)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(i)
        g = torch.Generator().manual_seed(self.seed + 100_000 + i)
        starts = torch.rand(self.seq, generator=g) < 0.35
        starts[0] = False
        return {**item, "document_ids": starts.long().cumsum(0)}


class LabelHoles(torch.utils.data.Dataset):
    """``data``'s samples with ``IGNORE_INDEX`` labels: at random positions of each sample (about
    40 %, drawn per sample), and at every position of each sample whose index is ``FULLY_IGNORED``
    modulo ``FULLY_IGNORED_EVERY``. The data ranks' batches then hold different labelled-token
    counts, and a one-row micro-batch of a fully ignored sample holds none."""

    HOLE_RATE, FULLY_IGNORED, FULLY_IGNORED_EVERY = 0.4, 5, 16

    def __init__(self, data: TokenData) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self.data[i]
        g = torch.Generator().manual_seed(self.data.seed + 200_000 + i)
        holes = torch.rand(item["labels"].shape, generator=g) < self.HOLE_RATE
        if i % self.FULLY_IGNORED_EVERY == self.FULLY_IGNORED:
            holes[:] = True
        return {**item, "labels": item["labels"].masked_fill(holes, IGNORE_INDEX)}


def make_data(packed: bool, ignore: bool = False, **kwargs: Any) -> torch.utils.data.Dataset:
    """``TokenData`` (``PackedData`` with ``packed``), its labels holed by :class:`LabelHoles` with ``ignore``."""
    data = PackedData(**kwargs) if packed else TokenData(**kwargs)
    return LabelHoles(data) if ignore else data


def pipeline_model_config(bias: bool = False, recompute: str = "") -> TransformerConfig:
    """``_models``' model with 4 blocks; ``bias``: the routers' aux-loss-free expert bias, stepped
    after every optimizer step; ``recompute``: one ``TransformerConfig.recompute`` target."""
    config = model_config(num_layers=NUM_LAYERS)
    if bias:
        config.moe = dataclasses.replace(config.moe, expert_bias=True, bias_update_rate=1e-2)
    if recompute:
        config = dataclasses.replace(config, recompute=[recompute])
    return config


class PipelineLM(RecordingLM):
    """``RecordingLM`` with 4 blocks and batches of ``BATCH`` rows (packed documents with ``packed``,
    labels holed by :class:`LabelHoles` with ``ignore``; the model of :func:`pipeline_model_config`)."""

    def __init__(self, packed: bool = False, ignore: bool = False, bias: bool = False, recompute: str = "") -> None:
        super().__init__(pipeline_model_config(bias, recompute))
        self.packed, self.ignore = packed, ignore

    def train_data(self) -> torch.utils.data.Dataset:
        return make_data(self.packed, self.ignore)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_data(), batch_size=BATCH, shuffle=False)


_RECIPE_KEYS = ("accum", "packed", "clip", "ignore", "bias", "recompute")


def parse(spec: str) -> dict[str, Any]:
    """``pp=2,ep=2,schedule=1f1b,v=1,n=4`` -> strategy keyword arguments (``sp=1``:
    ``sequence_parallel=True``; the keys of a :class:`Recipe`, ``accum``, ``packed``, ``clip`` and
    ``ignore``, are left out: see :func:`recipe`)."""
    names = {"schedule": "pp_schedule", "v": "pp_virtual_stages", "n": "pp_microbatches", "sp": "sequence_parallel"}
    out: dict[str, Any] = {}
    for item in spec.split(","):
        key, value = item.split("=")
        if key == "sp":
            out[names[key]] = value == "1"
        elif key not in _RECIPE_KEYS:
            out[names.get(key, key)] = value if key == "schedule" else int(value)
    return out


@dataclass(frozen=True)
class Recipe:
    """What a run trains on beyond its layout: ``accum`` batches per optimizer step, ``micro``
    micro-batches per batch, packed documents, labels holed by :class:`LabelHoles` (``ignore``)
    and the gradient-clipping norm (``clip``; 0: no clipping, so the gradients' overall scale
    reaches the parameters); the model's expert bias (``bias``) and recompute target (``recompute``)."""

    accum: int = ACCUM
    micro: int = MICRO
    packed: bool = False
    ignore: bool = False
    clip: float = CLIP
    bias: bool = False
    recompute: str = ""


def recipe(spec: str) -> Recipe:
    """A spec's :class:`Recipe`: ``accum=N`` (else ``ACCUM``), ``n=N`` (else ``MICRO``), ``packed=1``,
    ``ignore=1``, ``clip=X`` (else ``CLIP``), ``bias=1`` and ``recompute=<target>``."""
    items = dict(item.split("=") for item in spec.split(",") if "=" in item)  # "hf," names a model
    return Recipe(
        accum=int(items.get("accum", ACCUM)), micro=int(items.get("n", MICRO)), packed=items.get("packed") == "1",
        ignore=items.get("ignore") == "1", clip=float(items.get("clip", CLIP)), bias=items.get("bias") == "1",
        recompute=items.get("recompute", ""),
    )  # fmt: skip


def accumulation(spec: str) -> int:
    """``accum=N`` of a spec, else ``ACCUM``."""
    return recipe(spec).accum


def packed(spec: str) -> bool:
    """Whether a spec trains on packed documents (``packed=1``)."""
    return recipe(spec).packed


def mean_per_data_rank(losses: list[tuple[int, list[float]]]) -> list[tuple[int, list[float]]]:
    """One ``(dp_rank, losses)`` per data rank: the mean over the ranks that share its batches
    (under CP each rank's loss is its chunks' share, their mean the batch's)."""
    by_dp: dict[int, list[list[float]]] = {}
    for dp_rank, values in losses:
        by_dp.setdefault(dp_rank, []).append(values)
    return [(d, torch.tensor(rows, dtype=torch.float64).mean(0).tolist()) for d, rows in sorted(by_dp.items())]


def pipeline_reference(
    dp: int, steps: int, run: Recipe = Recipe()
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """``losses[batch][dp_rank]`` and the final parameters. A data rank's loss is its share of the
    batch's token mean: its micro-batches' token sums times ``dp`` over the labelled tokens of the
    batch on every data rank (with equal counts, the mean of its micro-batches' losses)."""
    losses, state, _ = _reference_run(dp, steps, run)
    return losses, state


def reference_moe_stats(dp: int, steps: int, run: Recipe = Recipe()) -> list[list[dict[str, float]]]:
    """``stats[batch][dp_rank]``: what one process running the batch's micro-batches logs as the
    batch's MoE statistics: ``train/<aux>`` the sum over MoE layers of each aux loss's mean over the
    micro-batches, ``load_imbalance/<layer>`` ``max/mean`` of the tokens routed to each expert summed
    over the micro-batches."""
    return _reference_run(dp, steps, run)[2]


def _batch_moe_stats(model: torch.nn.Module, per_micro: list[dict[str, torch.Tensor]], micro: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, layer in find_moe_layers(model):
        counts = torch.stack([m[name] for m in per_micro]).sum(0).double()
        out[f"load_imbalance/{name}"] = float(counts.max() / counts.mean())
    for key in {k for m in per_micro for k in m if k.startswith("train/")}:
        out[key] = float(sum(m[key] for m in per_micro) / micro)
    return out


def _micro_moe_record(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One micro-batch's routed counts per layer and aux losses summed over the layers."""
    record: dict[str, torch.Tensor] = {}
    for name, layer in find_moe_layers(model):
        record[name] = layer.last_tokens_per_expert.detach().clone()
        for key, value in layer.last_aux_losses.items():
            record[f"train/{key}"] = record.get(f"train/{key}", 0) + value.detach().double()
    return record


def _token_sum(lm: PipelineLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The cross-entropy of ``batch`` summed over its labelled tokens (0, in the graph, for none)."""
    extra = {k: batch[k] for k in ("position_ids", "document_ids") if k in batch}
    logits_BSV = lm(batch["input_ids"], **extra)
    count = int((batch["labels"] != IGNORE_INDEX).sum())
    if count == 0:
        return logits_BSV.sum() * 0.0
    return lm_cross_entropy(lm.model, logits_BSV, batch["labels"]) * count


@functools.lru_cache(maxsize=None)
def _reference_run(
    dp: int, steps: int, run: Recipe
) -> tuple[list[list[float]], dict[str, torch.Tensor], list[list[dict[str, float]]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        lm = PipelineLM(bias=run.bias, recompute=run.recompute)
        model = lm.model
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        data = make_data(run.packed, run.ignore)
        orders = [list(DistributedSampler(data, num_replicas=dp, rank=d, shuffle=True, seed=0)) for d in range(dp)]
        set_aux_loss_scale(model, 1.0 / (dp * run.accum * run.micro))
        losses: list[list[float]] = []
        stats: list[list[dict[str, float]]] = []
        for step in range(steps):
            for part in range(run.accum):
                b = step * run.accum + part
                batches = [
                    torch.utils.data.default_collate([data[i] for i in orders[d][b * BATCH : (b + 1) * BATCH]])
                    for d in range(dp)
                ]
                tokens = max(sum(int((x["labels"] != IGNORE_INDEX).sum()) for x in batches), 1)  # all data ranks
                row, stats_row = [], []
                for batch in batches:
                    total, records = 0.0, []
                    for m in range(run.micro):
                        loss_sum = _token_sum(lm, {k: v.chunk(run.micro)[m] for k, v in batch.items()})
                        records.append(_micro_moe_record(model))
                        (loss_sum / (tokens * run.accum)).backward()
                        total += float(loss_sum.detach())
                    row.append(total * dp / tokens)
                    stats_row.append(_batch_moe_stats(model, records, run.micro))
                losses.append(row)
                stats.append(stats_row)
            if run.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.clip)
            opt.step()
            opt.zero_grad()
            update_expert_biases(model)  # counts of every data rank's tokens, as the strategy's group sums them
        state = {f"model.{k}": v.detach().clone() for k, v in model.named_parameters()}
        state |= {f"model.{k}": v.detach().clone() for k, v in model.named_buffers() if k.endswith("expert_bias")}
        return losses, state, stats
    finally:
        torch.set_num_threads(threads)


def compare_moe_stats(
    recorded: list[tuple[int, list[dict[str, float]]]], spec: str, dp: int, steps: int, rtol: float, label: str
) -> None:
    """Every rank's logged MoE statistics of every batch equal the one-process numbers
    (:func:`reference_moe_stats`): the same keys (every MoE layer of the model), values to ``rtol``."""
    want_all = reference_moe_stats(dp, steps, recipe(spec))
    for rank, (dp_rank, batches) in enumerate(recorded):
        want = [row[dp_rank] for row in want_all]
        assert len(batches) == len(want), (label, rank, len(batches), len(want))
        for b, (got, expected) in enumerate(zip(batches, want)):
            assert set(got) == set(expected), (label, rank, b, sorted(set(got) ^ set(expected)))
            torch.testing.assert_close(
                torch.tensor([got[k] for k in sorted(expected)], dtype=torch.float64),
                torch.tensor([expected[k] for k in sorted(expected)], dtype=torch.float64),
                rtol=rtol, atol=rtol / 10, msg=lambda m, r=rank, i=b: f"{label} rank {r} batch {i} MoE stats: {m}",
            )  # fmt: skip


def reference_val_loss(state: dict[str, torch.Tensor], data: torch.utils.data.Dataset, bias: bool = False) -> float:
    """The mean next-token loss over every sample of ``data`` with parameters ``state`` (and the
    routers' expert biases with ``bias``; one forward: the loss of a token does not depend on the
    batch it is routed in)."""
    lm = PipelineLM(bias=bias)
    lm.load_state_dict(state, strict=False)
    batch = torch.utils.data.default_collate([data[i] for i in range(len(data))])
    with torch.no_grad():
        return float(lm._lm_loss(batch))


def compare(result: dict, spec: str, dp: int, steps: int, rtol: float = 1e-5, label: str = "") -> None:
    """Every rank's batch losses, the logged loss and the final parameters equal the reference."""
    atol = rtol / 10
    label = label or spec
    run = recipe(spec)
    ref_losses, ref_state = pipeline_reference(dp, steps, run)
    for rank, (dp_rank, losses) in enumerate(result["losses"]):
        want = [row[dp_rank] for row in ref_losses]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{label} rank {rank} losses: {m}")  # fmt: skip
    if "logged_loss" in result:
        last = torch.tensor(ref_losses[-1]).mean()
        torch.testing.assert_close(torch.tensor(result["logged_loss"]), last, rtol=rtol, atol=atol)
    if "moe_stats" in result:
        compare_moe_stats(result["moe_stats"], spec, dp, steps, rtol, label)
    assert set(result["state"]) == set(ref_state), (label, sorted(set(result["state"]) ^ set(ref_state)))
    if result.get("val_data") is not None:  # validation ran through the pipeline
        samples, seed = result["val_data"]
        want = reference_val_loss(ref_state, make_data(run.packed, run.ignore, num_samples=samples, seed=seed), run.bias)
        torch.testing.assert_close(torch.tensor(result["val_loss"]), torch.tensor(want), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{label} val/loss: {m}")  # fmt: skip
    for name, want in ref_state.items():
        torch.testing.assert_close(result["state"][name], want, rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{label} {n}: {m}")  # fmt: skip


@dataclass(frozen=True)
class Phase:
    """Optimizer steps a run trains at one layout: ``dp`` data ranks of ``rows`` rows each, every
    batch run as ``micro`` micro-batches (``micro=1``: one forward per batch, as at ``pp=1``)."""

    steps: int
    dp: int
    rows: int
    micro: int


def _epoch_order(data: TokenData, epoch: int) -> list[int]:
    """The epoch's permutation every data rank deals from (``DistributedSampler``, seed 0)."""
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def _adamw(lm: PipelineLM, config: OptimizerConfig, total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """The LightningModule's own AdamW and schedule (``configure_optimizers``, ``max_steps=total_steps``)."""
    lm.optimizer_config = config
    lm._trainer = SimpleNamespace(max_steps=total_steps, strategy=None)  # all configure_optimizers reads
    try:
        built = MoELanguageModel.configure_optimizers(lm)
    finally:
        lm._trainer = None
    return built["optimizer"], built["lr_scheduler"]["scheduler"]


@functools.lru_cache(maxsize=None)
def phased_reference(
    phases: tuple[Phase, ...], optimizer: OptimizerConfig, accum: int = ACCUM
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """``losses[batch][dp_rank]`` and the final parameters of one process that trains ``phases`` in
    turn with the LightningModule's AdamW and warm-up/cosine schedule over all their steps.

    The phases read one global stream of samples, as a resumable loader deals it after a change of
    data-parallel size: epoch ``e`` is ``DistributedSampler``'s permutation (seed 0, epoch ``e``), a
    batch is its next ``dp * rows`` samples, and data rank ``d`` takes positions ``d, d + dp, ...``
    of them. Each rank's loss is scaled by ``1 / (dp * accum * micro)`` per micro-batch, the aux
    losses likewise; clipping, the AdamW step and the schedule's step close each optimizer step.
    """
    data = TokenData()
    batch_rows = {p.dp * p.rows for p in phases}
    if len(batch_rows) != 1 or len(data) % next(iter(batch_rows)):
        raise ValueError(
            f"phased_reference: batches of {sorted(batch_rows)} rows over all data ranks must be one size that "
            f"divides the {len(data)} samples; give every phase the same dp * rows."
        )
    global_rows = batch_rows.pop()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        lm = PipelineLM()
        model = lm.model
        opt, schedule = _adamw(lm, optimizer, sum(p.steps for p in phases))
        losses: list[list[float]] = []
        position = 0  # samples of the whole run read so far, all data ranks together
        for phase in phases:
            scale = 1.0 / (phase.dp * accum * phase.micro)
            set_aux_loss_scale(model, scale)
            for _ in range(phase.steps * accum):
                epoch, start = divmod(position, len(data))
                order = _epoch_order(data, epoch)
                row = []
                for d in range(phase.dp):
                    idx = [order[start + d + phase.dp * j] for j in range(phase.rows)]
                    batch = torch.utils.data.default_collate([data[i] for i in idx])
                    total = 0.0
                    for m in range(phase.micro):
                        loss = lm._lm_loss({k: v.chunk(phase.micro)[m] for k, v in batch.items()})
                        (loss * scale).backward()
                        total += float(loss.detach())
                    row.append(total / phase.micro)
                losses.append(row)
                position += global_rows
                if len(losses) % accum == 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                    opt.step()
                    schedule.step()
                    opt.zero_grad()
        return losses, {f"model.{k}": v.detach().clone() for k, v in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def compare_phased(
    result: dict, phases: tuple[Phase, ...], optimizer: OptimizerConfig, first_batch: int, label: str,
    rtol: float = 1e-5, loss_atol: float = 1e-6, state_atol: float = 1e-6,
) -> None:  # fmt: skip
    """Every rank's batch losses (``result["losses"]``: ``(dp_rank, losses)`` per rank, the run's
    batches from ``first_batch`` of :func:`phased_reference` on) and the final parameters
    (``result["state"]``) equal the reference: ``rtol`` for both, ``loss_atol`` and ``state_atol``."""
    ref_losses, ref_state = phased_reference(phases, optimizer)
    for rank, (dp_rank, losses) in enumerate(result["losses"]):
        want = [row[dp_rank] for row in ref_losses[first_batch:]]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=rtol, atol=loss_atol,
                                   msg=lambda m, r=rank: f"{label} rank {r} losses: {m}")  # fmt: skip
    assert set(result["state"]) == set(ref_state), (label, sorted(set(result["state"]) ^ set(ref_state)))
    for name, want in ref_state.items():
        torch.testing.assert_close(result["state"][name], want, rtol=rtol, atol=state_atol,
                                   msg=lambda m, n=name: f"{label} {n}: {m}")  # fmt: skip
