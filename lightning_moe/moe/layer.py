"""The MoE FFN layer: router → dispatch → grouped experts → combine (+ shared expert).

Legend: T tokens, H hidden, E experts, K experts per token, R dispatched rows.

Stages of :meth:`MoELayer.forward`:

1. Router (``moe/router.py``): fp32 logits, top-k ids and weights, capacity drops.
2. Aux losses (``moe/losses.py``): load balancing (switch / seq / global) and z-loss, attached
   to the output by :class:`AuxLossScaler` so they reach backward with ``aux_loss_scale``.
3. ``dispatcher.dispatch``: rows grouped by local expert (local: a gather; expert parallel: an
   all-to-all over the EP group — the dispatcher decides, the layer does not ask).
4. ``experts``: one grouped GEMM per projection; the routing weight is applied inside the
   SwiGLU when ``memory_efficient_permute`` (then the combine is a plain sum).
5. ``dispatcher.combine``: back to token order, summed over the K slots.
6. Shared expert, optionally gated by ``sigmoid(x @ g)``, added.

Published hooks (what callbacks and the LightningModule read or set): ``last_aux_losses``,
``last_tokens_per_expert`` (routed, before drops), ``last_dropped_fraction``,
``last_router_entropy`` (when ``record_router_entropy`` is set), ``aux_loss_scale``,
``router.set_routing_override``, ``dispatcher``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_moe.config import MoEConfig
from lightning_moe.moe.dispatch import Dispatcher, LocalDispatcher
from lightning_moe.moe.dispatch.base import fp8_rows_for
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.moe.losses import (
    AuxLossScaler,
    aux_probs,
    load_balancing_loss,
    sequence_load_balancing_loss,
    z_loss,
)
from lightning_moe.moe.router import RouterOutput, TopKRouter, expert_capacity
from lightning_moe.ops.deferred import Deferred
from lightning_moe.ops.permute import Permutation
from lightning_moe.ops.streams import side_stream
from lightning_moe.ops.swiglu import SwiGLUOptions

__all__ = ["MoELayer", "SharedExpert", "router_entropy"]

# the ``last_aux_losses`` key of each ``MoEConfig.aux_loss``
_BALANCE_LOSS_NAMES = {
    "switch": "load_balancing_loss",
    "seq": "seq_load_balancing_loss",
    "global": "global_load_balancing_loss",
}


@torch.no_grad()
def router_entropy(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Mean over tokens of ``H(p_t) = -sum_i p_ti log p_ti`` in nats (0: one expert, ``log E``: uniform).

    ``p_t`` is the softmax of token t's logits over all E experts, or its sigmoid scores
    normalised to sum to one. A monitoring statistic only: no gradient, no host sync.
    """
    if score_func == "sigmoid":
        probs_TE = torch.sigmoid(logits_TE.float())
        probs_TE = probs_TE / probs_TE.sum(-1, keepdim=True).clamp(min=1e-20)
        log_probs_TE = probs_TE.clamp(min=1e-20).log()
    else:
        log_probs_TE = torch.log_softmax(logits_TE.float(), dim=-1)
        probs_TE = log_probs_TE.exp()
    return -(probs_TE * log_probs_TE).sum(-1).mean()


class SharedExpert(nn.Module):
    """A dense SwiGLU FFN every token passes through; optional scalar sigmoid gate per token."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, gated: bool, init_std: float = 0.02) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=False)
        self.down = nn.Linear(ffn_hidden_size, hidden_size, bias=False)
        self.gate = nn.Linear(hidden_size, 1, bias=False) if gated else None
        for p in self.parameters():
            nn.init.normal_(p, std=init_std)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        gate_TF, up_TF = self.gate_up(x_TH).chunk(2, dim=-1)
        y_TH = self.down(F.silu(gate_TF) * up_TF)
        if self.gate is not None:
            y_TH = torch.sigmoid(self.gate(x_TH)) * y_TH
        return y_TH


def _summed_counts(counts_E: torch.Tensor, num_tokens: int, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert counts and token count summed over ``group`` (one all-reduce; no gradient)."""
    import torch.distributed as dist

    counts_and_num = torch.cat([counts_E.detach().float(), counts_E.new_full((1,), float(num_tokens)).float()])
    dist.all_reduce(counts_and_num, group=group)
    return counts_and_num[:-1], counts_and_num[-1]


def _check_on_input_dispatcher(dispatcher: Dispatcher, layer_name: str) -> None:
    from lightning_moe.moe.dispatch.echo import EchoDispatcher

    if isinstance(dispatcher, EchoDispatcher):  # its clone experts weight their outputs inside combine
        raise ValueError(
            f"{layer_name}: routing_weight_on_input=True under ECHO expert cloning, whose clone experts weight "
            "their outputs; drop the ECHO callback or set routing_weight_on_input=False."
        )


class MoELayer(nn.Module):
    """Mixture-of-Experts FFN: ``forward(x[..., H]) -> y[..., H]``.

    Built with a :class:`LocalDispatcher`; the strategy replaces ``dispatcher`` (and sets
    ``aux_loss_group`` for the global aux loss) when it shards experts.
    """

    def __init__(self, config: MoEConfig, layer_name: str = "MoELayer") -> None:
        super().__init__()
        self.config = config
        self.layer_name = layer_name
        self.router = TopKRouter(config)
        self.experts = GroupedExperts(
            config.num_experts, config.hidden_size, config.ffn_hidden_size, config.experts_backend, config.init_std,
            kernels=config.kernels, fp8=config.fp8, mlp_bias=config.expert_mlp_bias,
            swiglu=SwiGLUOptions(config.swiglu_alpha, config.swiglu_limit, config.swiglu_up_offset),
        )
        self.experts.fuse_wgrad_accumulation = config.fuse_wgrad_accumulation
        self.shared_expert = (
            SharedExpert(config.hidden_size, config.shared_expert_ffn_size, config.shared_expert_gate, config.init_std)
            if config.shared_expert_ffn_size is not None
            else None
        )
        self.dispatcher: Dispatcher = LocalDispatcher(config.num_experts, dropless=config.capacity_factor is None)
        self.aux_loss_scale: float = 1.0
        self.aux_loss_group: Any = None
        # ranks holding the other tokens of the same sequences (context parallel): the switch loss
        # takes its per-expert counts over all of them, so the group's mean loss is the sequences'
        self.aux_loss_sequence_group: Any = None
        # ranks whose gradients of these aux losses are summed, not averaged (sequence parallel:
        # each TP rank holds a shard of the same sequences); each rank's loss counts 1/aux_loss_shards
        self.aux_loss_shards: int = 1
        self.last_aux_losses: dict[str, torch.Tensor] = {}
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.last_dropped_fraction: torch.Tensor | None = None
        self.last_router_entropy: torch.Tensor | None = None
        self.record_router_entropy = False  # a [T, E] pass per forward: on only when a monitor asks
        self.register_buffer("global_tokens_per_expert", torch.zeros(config.num_experts), persistent=False)
        self.register_buffer("global_num_tokens", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        self._check_input(x)
        lead_shape = x.shape[:-1]
        x_TH = x.reshape(-1, cfg.hidden_size)
        T = x_TH.shape[0]

        fused = self._route_and_permute(x_TH)  # router + permutation + moved rows in one call, when it applies
        routing = fused[0] if fused is not None else self.router(x_TH)
        if cfg.check_finite and not bool(torch.isfinite(routing.logits_TE).all()):  # SYNC: opt-in check
            raise FloatingPointError(
                f"{self.layer_name}: router logits are not finite (NaN/Inf in the input or the router weight); "
                "lower the learning rate or check the data, or set check_finite=False to skip this check."
            )
        capacity = (
            expert_capacity(T, cfg.top_k, cfg.num_experts, cfg.capacity_factor)
            if cfg.pad_to_capacity and cfg.capacity_factor is not None
            else None
        )
        shared = _SharedOnSideStream(self.shared_expert, x_TH) if self._overlap_shared(x_TH) else None
        y_TH = self._routed_experts(x_TH, routing, fused, capacity).to(x.dtype)
        if shared is not None:
            y_TH = y_TH + shared.join().to(y_TH.dtype)
        elif self.shared_expert is not None:
            y_TH = y_TH + self.shared_expert(x_TH).to(y_TH.dtype)

        self._record(routing, T)
        aux_total = self._aux_losses(routing, lead_shape)
        if aux_total is not None and torch.is_grad_enabled() and self.training:
            y_TH = AuxLossScaler.apply(y_TH, aux_total, self.aux_loss_scale / self.aux_loss_shards)
        return y_TH.view(*lead_shape, cfg.hidden_size)

    # ------------------------------------------------------------------------------------------

    def _check_input(self, x: object) -> None:
        hidden_size = self.config.hidden_size
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.layer_name}: input is a {type(x).__name__}, not a tensor; pass a [..., H] tensor.")
        if not x.dtype.is_floating_point:
            raise TypeError(
                f"{self.layer_name}: input dtype={x.dtype} is not a floating dtype; pass activations in float32, "
                "bfloat16 or float16 (token ids go through an embedding first)."
            )
        if x.shape[-1] != hidden_size:
            raise ValueError(
                f"{self.layer_name}: input has hidden size {x.shape[-1]}, the layer was built for "
                f"hidden_size={hidden_size}; pass [..., {hidden_size}] activations."
            )

    def _routed_experts(
        self,
        x_TH: torch.Tensor,
        routing: RouterOutput,
        fused: tuple[RouterOutput, Permutation, Deferred] | None,
        capacity: int | None,
    ) -> torch.Tensor:
        """Stages 3 to 5: the routed experts' ``y_TH``, back in token order and summed over the K slots."""
        on_input = self.config.routing_weight_on_input  # the weight scales the expert's input rows (Llama 4)
        me = self.config.memory_efficient_permute and not on_input
        if me and self.dispatcher.capabilities.runs_experts:  # the dispatcher fuses its three stages (fast path)
            run_experts = self.dispatcher.run_experts  # type: ignore[attr-defined]
            weights_TK = lambda: routing.topk_weights_TK  # noqa: E731  (read after the first expert GEMM's launch)
            moved = () if fused is None else (fused[1], fused[2])  # the router's permutation and moved rows
            return run_experts(x_TH, routing.topk_ids_TK, weights_TK, capacity, self.experts, *moved)
        # FP8 experts with Fp8Config(dispatch=True): the dispatcher quantizes the rows before its exchange
        self.dispatcher.fp8_rows = fp8_rows_for(self.dispatcher, self.experts.fp8_rows(x_TH.device))
        dispatched, handle = self.dispatcher.dispatch(x_TH, routing.topk_ids_TK, routing.topk_weights_TK, capacity)
        x_RH = dispatched.x_RH
        if on_input:
            _check_on_input_dispatcher(self.dispatcher, self.layer_name)
            x_RH = x_RH * dispatched.weights_R.unsqueeze(-1).to(x_RH.dtype)
        y_RH = self.experts(
            x_RH, dispatched.tokens_per_expert_e, dispatched.weights_R if me else None,
            x_fp8=getattr(dispatched, "x_fp8", None),  # FP8 rows of an FP8-capable dispatcher
        )
        return self.dispatcher.combine(y_RH, handle, weighted=not (me or on_input))

    def _record(self, routing: RouterOutput, num_tokens: int) -> None:
        self.last_tokens_per_expert = routing.tokens_per_expert_E.detach()
        if self.record_router_entropy:
            self.last_router_entropy = router_entropy(routing.logits_TE, self.config.score_func)
        if self.config.capacity_factor is None:
            self.last_dropped_fraction = None
        else:
            dropped = (routing.topk_ids_TK < 0).sum()
            self.last_dropped_fraction = dropped.float() / max(num_tokens * self.config.top_k, 1)

    def aux_loss_names(self) -> tuple[str, ...]:
        """The keys of ``last_aux_losses`` after a forward in training mode (none in eval)."""
        cfg = self.config
        names = [_BALANCE_LOSS_NAMES[cfg.aux_loss]] if cfg.aux_loss != "none" and cfg.aux_loss_coeff > 0 else []
        if cfg.z_loss_coeff is not None and cfg.z_loss_coeff > 0:
            names.append("z_loss")
        return tuple(names)

    def _aux_losses(self, routing: RouterOutput, lead_shape: torch.Size) -> torch.Tensor | None:
        cfg = self.config
        losses: dict[str, torch.Tensor] = {}
        if cfg.aux_loss != "none" and cfg.aux_loss_coeff > 0 and self.training:
            probs_TE = aux_probs(routing.logits_TE, cfg.score_func)
            T = probs_TE.shape[0]
            if cfg.aux_loss == "switch":
                counts_E, num_counted = routing.tokens_per_expert_E, T
                if self.aux_loss_sequence_group is not None:
                    counts_E, num_counted = _summed_counts(counts_E, T, self.aux_loss_sequence_group)
                losses[_BALANCE_LOSS_NAMES["switch"]] = load_balancing_loss(
                    probs_TE, counts_E, num_counted, cfg.top_k, cfg.aux_loss_coeff
                )
            elif cfg.aux_loss == "seq":
                B = lead_shape[0] if len(lead_shape) > 1 else 1
                losses[_BALANCE_LOSS_NAMES["seq"]] = sequence_load_balancing_loss(
                    probs_TE.view(B, T // max(B, 1), cfg.num_experts),  # sizes named: B may be 0
                    routing.routed_ids_TK.view(B, T // max(B, 1), cfg.top_k),
                    cfg.top_k,
                    cfg.aux_loss_coeff,
                )
            else:
                counts_E, num_counted = self._global_counts(routing.tokens_per_expert_E, T)
                losses[_BALANCE_LOSS_NAMES["global"]] = load_balancing_loss(
                    probs_TE, counts_E, num_counted, cfg.top_k, cfg.aux_loss_coeff
                )
        if cfg.z_loss_coeff is not None and cfg.z_loss_coeff > 0 and self.training:
            losses["z_loss"] = z_loss(routing.logits_TE, cfg.z_loss_coeff)
        self.last_aux_losses = {k: v.detach() for k, v in losses.items()}
        return sum(losses.values()) if losses else None  # type: ignore[return-value]

    def _route_and_permute(self, x_TH: torch.Tensor) -> tuple[RouterOutput, Permutation, Deferred] | None:
        """The router's output, the permutation and the moved rows from one extension call
        (``TopKRouter.route_and_permute``) when the single-rank dropless fast path runs; else ``None``."""
        cfg = self.config
        if not (cfg.memory_efficient_permute and cfg.capacity_factor is None) or cfg.routing_weight_on_input:
            return None
        if not self.dispatcher.capabilities.takes_router_permutation:
            return None
        return self.router.route_and_permute(x_TH)

    def _overlap_shared(self, x_TH: torch.Tensor) -> bool:
        return self.shared_expert is not None and self.config.shared_expert_overlap and x_TH.is_cuda

    def _global_counts(self, tokens_per_expert_E: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Counts summed over this step's micro-batches so far and over ``aux_loss_group``."""
        counts_E = tokens_per_expert_E.float()
        num = counts_E.new_full((), float(num_tokens))  # a fill kernel: no host copy (capturable)
        if self.aux_loss_group is not None:
            import torch.distributed as dist

            counts_and_num = torch.cat([counts_E, num.view(1)])
            dist.all_reduce(counts_and_num, group=self.aux_loss_group)
            counts_E, num = counts_and_num[:-1], counts_and_num[-1]
        self.global_tokens_per_expert += counts_E
        self.global_num_tokens += num
        return self.global_tokens_per_expert.clone(), self.global_num_tokens.clone()

    def reset_global_aux_counts(self) -> None:
        """Call once per optimizer step (the LightningModule does) for ``aux_loss='global'``."""
        self.global_tokens_per_expert.zero_()
        self.global_num_tokens.zero_()

    def extra_repr(self) -> str:
        return f"name={self.layer_name!r}, dispatcher={self.dispatcher!r}"


class _SharedOnSideStream:
    """The shared expert launched on a side stream; :meth:`join` makes the caller's stream wait.

    Autograd runs each node's backward on the stream its forward ran on, so the shared expert's
    backward overlaps the routed path's backward too. Tensors crossing streams are recorded on the
    stream that uses them last, so the caching allocator does not hand their memory out early.
    """

    def __init__(self, shared_expert: nn.Module, x_TH: torch.Tensor) -> None:
        device = x_TH.device
        self.main = torch.cuda.current_stream(device)
        self.side = side_stream(device, 0)
        self.side.wait_stream(self.main)  # x_TH is ready
        with torch.cuda.stream(self.side):
            x_TH.record_stream(self.side)
            self.out_TH = shared_expert(x_TH)

    def join(self) -> torch.Tensor:
        self.main.wait_stream(self.side)
        self.out_TH.record_stream(self.main)
        return self.out_TH
