"""The Hugging Face pipeline test's model and its one-process reference.

A tiny random Qwen3-MoE causal LM (4 decoder layers, every one MoE, switch aux loss and z-loss, fp32,
untied embeddings) built from an inline config, its MoE blocks swapped as ``HFMoELanguageModel``
does, trained with SGD. The reference runs the micro-batches of each data-parallel shard one after
the other in one process, each loss and aux loss scaled by ``1 / (dp * accumulate * micro)``: the
arithmetic the pipeline must equal. Stage parameter names are mapped to the model's with
``hf_parameter_name`` before comparing. The Trainer's HF pipeline test and the Fabric pipeline
test (its specs starting ``hf,``, :func:`hf_spec`) train this model and compare with this reference.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from _models import CLIP, LR, VOCAB
from _pipeline_models import BATCH, accumulation, make_data, packed, parse
from lightning_moe.lit_hf import HFMoELanguageModel
from lightning_moe.models.hf_pipeline_stage import HFLocalStages, hf_parameter_name
from lightning_moe.parallel.checkpoint import gather_full_state
from lightning_moe.moe.utils import set_aux_loss_scale

HF_CONFIG: dict[str, Any] = dict(
    model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, pad_token_id=2,
)  # fmt: skip
MOE = {"aux_loss": "switch", "aux_loss_coeff": 0.01, "z_loss_coeff": 1e-3, "experts_backend": "torch"}
VAL = (8, 7)  # validation data (num_samples, seed)


class HFRecordingLM(HFMoELanguageModel):
    """The tiny Qwen3-MoE with SGD and every batch loss recorded, batches of ``BATCH`` rows (packed
    documents, training and validation, with ``packed``)."""

    def __init__(self, packed: bool = False) -> None:
        super().__init__(hf_config=dict(HF_CONFIG), moe=dict(MOE), log_layer_load=False)
        self.recorded: list[float] = []
        self.packed = packed

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.recorded.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(self.packed), batch_size=BATCH, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_data(self.packed, num_samples=VAL[0], seed=VAL[1]), batch_size=BATCH)


HF_PREFIX = "hf,"  # a spec of the Fabric pipeline test that trains this model: "hf,pp=2,ep=2,..."


def hf_spec(spec: str) -> tuple[bool, str]:
    """``(is_hf, layout)``: whether ``spec`` names this model (``hf,`` first) and the layout spec
    after it (``_pipeline_models.parse``)."""
    return spec.startswith(HF_PREFIX), spec.removeprefix(HF_PREFIX)


def model_names(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s full parameters (``gather_full_state``, collective) under the HF model's names
    (``model.embed_tokens.weight``, ...): a rank's stages mapped, a whole model as it is."""
    state = gather_full_state(model)
    if not isinstance(model, HFLocalStages):
        return state
    return {hf_parameter_name(k): v for k, v in state.items()}


@functools.lru_cache(maxsize=None)
def hf_reference(
    dp: int, steps: int, accum: int, micro: int, is_packed: bool = False
) -> tuple[list[list[float]], dict[str, torch.Tensor], float]:
    """``losses[batch][dp_rank]``, the final parameters (HF names) and the final validation loss."""
    torch.manual_seed(0)
    lm = HFRecordingLM()
    model = lm.model
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data = make_data(is_packed)
    orders = [list(DistributedSampler(data, num_replicas=dp, rank=d, shuffle=True, seed=0)) for d in range(dp)]
    scale = 1.0 / (dp * accum * micro)
    set_aux_loss_scale(model, scale)
    losses: list[list[float]] = []
    for step in range(steps):
        for part in range(accum):
            row = []
            for d in range(dp):
                b = step * accum + part
                idx = orders[d][b * BATCH : (b + 1) * BATCH]
                batch = torch.utils.data.default_collate([data[i] for i in idx])
                total = 0.0
                for m in range(micro):
                    loss = lm._lm_loss({k: v.chunk(micro)[m] for k, v in batch.items()})
                    (loss * scale).backward()
                    total += float(loss.detach())
                row.append(total / micro)
            losses.append(row)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    val_data = make_data(is_packed, num_samples=VAL[0], seed=VAL[1])
    with torch.no_grad():
        val = float(lm._lm_loss(torch.utils.data.default_collate([val_data[i] for i in range(len(val_data))])))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}, val


def compare_hf(result: dict, spec: str, dp: int, steps: int, rtol: float = 1e-5) -> None:
    """Every rank's batch losses, the logged and validation losses and the final parameters equal the reference."""
    atol = rtol / 10
    ref_losses, ref_state, ref_val = hf_reference(
        dp, steps, accumulation(spec), parse(spec)["pp_microbatches"], packed(spec)
    )
    for rank, (dp_rank, losses) in enumerate(result["losses"]):
        want = [row[dp_rank] for row in ref_losses]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{spec} rank {rank} losses: {m}")  # fmt: skip
    last = torch.tensor(ref_losses[-1]).mean()
    torch.testing.assert_close(torch.tensor(result["logged_loss"]), last, rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(result["val_loss"]), torch.tensor(ref_val), rtol=rtol, atol=atol,
                               msg=lambda m: f"{spec} val/loss: {m}")  # fmt: skip
    assert set(result["state"]) == set(ref_state), sorted(set(result["state"]) ^ set(ref_state))
    for name, want in ref_state.items():
        torch.testing.assert_close(result["state"][name], want, rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{spec} {n}: {m}")  # fmt: skip
