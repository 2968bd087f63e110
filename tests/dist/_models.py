"""The tiny model, data and one-process reference shared by the Trainer-level dist tests."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from lightning_moe.config import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.transformer import TransformerConfig
from lightning_moe.moe.utils import set_aux_loss_scale

def leave_together() -> None:
    """Every rank waits for the others, then tears the process group down before the interpreter does.

    A rank that reaches interpreter exit while another still uses the group can abort in gloo's
    teardown ("terminate called without an active exception", SIGABRT) after its work succeeded.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


VOCAB, SEQ, BATCH, NUM_SAMPLES = 64, 8, 2, 48
ACCUM, STEPS, CLIP, LR = 2, 3, 0.05, 0.5


def model_config(fuse_wgrad_accumulation: bool = False, num_layers: int = 3) -> TransformerConfig:
    moe = MoEConfig(
        fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        hidden_size=32,
        ffn_hidden_size=16,
        num_experts=8,
        top_k=2,
        aux_loss="switch",
        aux_loss_coeff=0.01,
        z_loss_coeff=1e-3,
        shared_expert_ffn_size=16,
    )
    return TransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=num_layers, num_heads=4, num_kv_heads=2, moe=moe,
        num_dense_layers=1, dense_ffn_hidden_size=32, max_seq_len=SEQ,
    )  # fmt: skip


class TokenData(Dataset):
    """Random token windows, the same on every rank: sample ``i`` is seeded by ``seed + i``."""

    def __init__(self, num_samples: int = NUM_SAMPLES, seq: int = SEQ, seed: int = 1000, vocab: int = VOCAB) -> None:
        self.num_samples, self.seq, self.seed, self.vocab = num_samples, seq, seed, vocab

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed + i)
        w = torch.randint(0, self.vocab, (self.seq + 1,), generator=g)
        return {"input_ids": w[:-1], "labels": w[1:]}


class RecordingLM(MoELanguageModel):
    """MoELanguageModel with SGD (no schedule) and every micro-batch loss recorded.

    Defaults are the fit/checkpoint workers' model; other workers pass their own and override
    :meth:`train_data` (data stays out of the init arguments, which land in the checkpoint).
    """

    def __init__(self, config: TransformerConfig | None = None, lr: float = LR) -> None:
        super().__init__(config or model_config(), log_layer_load=False)
        self.lr = lr
        self.recorded: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.recorded.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_data(self) -> Dataset:
        return TokenData()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_data(), batch_size=BATCH, shuffle=False)


@functools.lru_cache(maxsize=None)
def reference(dp: int, steps: int = STEPS) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One process, exactly equivalent: each DP shard is its own micro-batch, scaled by 1/(DP*ACCUM).

    Lightning always gives a training loader a shuffling DistributedSampler (seed 0, epoch 0).

    Returns ``losses[micro_batch][dp_rank]`` and the final parameters (cached per ``(dp, steps)``).
    Runs on one intra-op thread: the model is tiny, and on a loaded 2-core machine an OpenMP
    pool spinning for busy cores makes it many times slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(dp, steps)
    finally:
        torch.set_num_threads(threads)


def _reference(dp: int, steps: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    lm = RecordingLM()
    model = lm.model
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data = TokenData()
    orders = [list(DistributedSampler(data, num_replicas=dp, rank=d, shuffle=True, seed=0)) for d in range(dp)]
    losses: list[list[float]] = []
    set_aux_loss_scale(model, 1.0 / (dp * ACCUM))
    for step in range(steps):
        for micro in range(ACCUM):
            row = []
            for d in range(dp):
                b = step * ACCUM + micro
                idx = orders[d][b * BATCH : (b + 1) * BATCH]
                batch = torch.utils.data.default_collate([data[i] for i in idx])
                loss = lm._lm_loss(batch)
                (loss / (dp * ACCUM)).backward()
                row.append(float(loss.detach()))
            losses.append(row)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return losses, {f"model.{k}": v.detach().clone() for k, v in model.named_parameters()}


def compare_with_reference(
    result: dict, label: str, dp: int, steps: int | None = None, rtol: float | None = None
) -> None:
    """Every rank's micro-batch losses and the final parameters equal the one-process run (1e-5).

    ``LIGHTNING_MOE_PARITY_RTOL`` loosens the tolerance for GPU runs against the CPU reference;
    ``rtol`` (a bf16 run against the fp32 reference) overrides both.
    """
    rtol = rtol if rtol is not None else float(os.environ.get("LIGHTNING_MOE_PARITY_RTOL", "1e-5"))
    atol = rtol / 10
    ref_losses, ref_state = reference(dp) if steps is None else reference(dp, steps)
    for rank, (dp_rank, losses) in enumerate(result["losses"]):
        want = [row[dp_rank] for row in ref_losses]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{label} rank {rank} losses: {m}")  # fmt: skip
    assert set(result["state"]) == set(ref_state), label
    for name, want in ref_state.items():
        torch.testing.assert_close(result["state"][name], want, rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{label} {n}: {m}")  # fmt: skip
