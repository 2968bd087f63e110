"""parallel/fold_batch.py without processes: CP batch sharding and the token-weighted loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.parallel.context import unshard_sequence
from lightning_moe.parallel.fold_batch import check_sequence_length, lm_token_mean_loss, shard_batch, token_mean_loss


def _batch(B: int = 2, S: int = 8, packed: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 50, (B, S), generator=g), "labels": torch.randint(0, 50, (B, S), generator=g)}
    if packed:
        batch["document_ids"] = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]] * B)[:, :S]
        batch["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]] * B)[:, :S]
    batch["sample_id"] = torch.arange(B)  # not per token: kept as it is
    return batch


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_the_cp_ranks_shards_put_back_together_are_the_batch(cp: int, packed: bool) -> None:
    batch = _batch(packed=packed)
    shards = [shard_batch(batch, cp, r) for r in range(cp)]
    for key in ("input_ids", "labels", "position_ids") + (("document_ids",) if packed else ()):
        whole = unshard_sequence([s[key] for s in shards], cp)
        want = batch[key] if key in batch else torch.arange(8).expand(2, 8)
        assert torch.equal(whole, want), key
    assert all(torch.equal(s["sample_id"], batch["sample_id"]) for s in shards)


def test_rank_0_of_cp2_holds_the_first_and_the_last_quarter_with_their_global_positions() -> None:
    shard = shard_batch(_batch(), 2, 0)
    assert shard["position_ids"].tolist() == [[0, 1, 6, 7], [0, 1, 6, 7]]
    assert torch.equal(shard["input_ids"], _batch()["input_ids"][:, [0, 1, 6, 7]])


def test_cp1_returns_the_batch_itself() -> None:
    batch = _batch(S=7)
    assert shard_batch(batch, 1, 0) is batch


def test_a_length_that_is_not_a_multiple_of_2cp_is_named_with_the_multiple() -> None:
    with pytest.raises(ValueError, match=r"Owner: sequence length 6 is not a multiple of 2\*cp=4 .* use a sequence length of 8 or 4"):
        shard_batch(_batch(S=6), 2, 1, owner="Owner")
    with pytest.raises(ValueError, match=r"sequence length 3 is not a multiple of 2\*cp=4 .* of 4 \(any"):
        check_sequence_length("x", 3, 2)


def test_per_token_entries_of_another_shape_and_non_dict_batches_are_refused() -> None:
    batch = _batch()
    batch["labels"] = batch["labels"][:, :4]
    with pytest.raises(ValueError, match=r"batch\['labels'\] has shape \(2, 4\), input_ids \(2, 8\)"):
        shard_batch(batch, 2, 0)
    with pytest.raises(TypeError, match="shards dict batches"):
        shard_batch([torch.zeros(2, 8)], 2, 0)  # type: ignore[arg-type]


def test_token_mean_loss_without_a_group_is_the_mean_over_labelled_tokens() -> None:
    logits = torch.randn(2, 8, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 8))
    labels[0, :5] = -100
    got = lm_token_mean_loss(torch.nn.Linear(1, 1), logits, labels)
    torch.testing.assert_close(got, F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    loss, count = token_mean_loss(torch.tensor(6.0), torch.tensor(3), None, 4)
    assert float(loss) == 2.0 and float(count) == 3.0


def test_no_labelled_token_gives_zero_not_nan() -> None:
    loss, count = token_mean_loss(torch.tensor(0.0), torch.tensor(0), None, 1)
    assert float(loss) == 0.0 and float(count) == 0.0


def _strategy_before_processes(model: torch.nn.Module, **kwargs: object) -> tuple[object, list[int]]:
    """A FoldedMoEStrategy for 4 ranks whose setup_environment runs its checks without processes."""
    import types

    from lightning_moe.strategies import FoldedMoEStrategy

    strategy = FoldedMoEStrategy(**kwargs)  # type: ignore[arg-type]
    strategy.parallel_devices = [None] * 4  # type: ignore[list-item]
    strategy._lightning_module = model
    called: list[int] = []
    strategy._setup_distributed = types.MethodType(lambda self: called.append(1), strategy)  # type: ignore[method-assign]
    return strategy, called


def _lm(aux_loss: str = "switch") -> torch.nn.Module:
    from lightning_moe.config import MoEConfig
    from lightning_moe.lit import MoELanguageModel
    from lightning_moe.models.transformer import TransformerConfig

    moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, aux_loss=aux_loss)
    return MoELanguageModel(TransformerConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=4, moe=moe))


def test_cp2_refuses_attention_it_cannot_wrap_before_any_collective() -> None:
    model = _lm()
    model.model.layers[0].extra = torch.nn.MultiheadAttention(32, 2, batch_first=True)
    strategy, called = _strategy_before_processes(model, cp=2, ep=2)
    with pytest.raises(TypeError, match=r"module 'model\.layers\.0\.extra' \(MultiheadAttention\) is attention"):
        strategy.setup_environment()  # type: ignore[attr-defined]
    assert called == []
    assert all(m.cp_group is None for m in model.modules() if hasattr(m, "cp_group"))  # nothing enabled


def test_cp2_refuses_the_per_sequence_aux_loss_before_any_collective() -> None:
    strategy, called = _strategy_before_processes(_lm("seq"), cp=2, ep=2)
    with pytest.raises(ValueError, match=r"FoldedMoEStrategy: cp=2 with aux_loss='seq' at 'model\.layers\.0\.ffn'"):
        strategy.setup_environment()  # type: ignore[attr-defined]
    assert called == []
