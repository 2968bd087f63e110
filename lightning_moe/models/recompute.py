"""Fine-grained activation recompute of the transformer blocks (a config option, not a callback).

Legend: B batch, S sequence, H hidden, T = B·S tokens, K top-k, R dispatched rows (K·T when
dropless), F expert FFN width; ``u`` is one ``[T, H]`` activation in the model dtype.

``TransformerConfig(recompute=[...])`` names what a block does *not* keep for backward:

==========  ========================================================================  ====================
target      dropped in forward, rebuilt in backward                                    rebuild cost
==========  ========================================================================  ====================
``norm``    both RMSNorm outputs (1 u each: the attention input q/k/v keep, the MoE    2 elementwise passes
            input the router and experts keep, or the router's fp32 copy of it), and
            the norms' internals
``moe_act`` the experts' pre-activation ``h_R2F = x_RH @ w13`` (2·F·K/H u: the       one grouped GEMM
            largest tensor the fused local MoE path keeps), rebuilt by re-gathering    (2/18 of the
            ``x_RH`` from the token-order input and one grouped GEMM. Never saved in   experts' FLOPs)
            any case: the SwiGLU output ``a_RF`` (``ops/expert_mlp.py`` and
            ``ops/local_experts.py`` recompute it from ``h_R2F``) and, on the fused
            path, ``x_RH``; on the unfused path ``moe_act`` re-gathers ``x_RH`` too
``moe``     everything inside the MoE layer                                            the layer's forward
``attn``    everything inside the attention sublayer (q/k/v/o projections, RoPE,      the sublayer's
            SDPA): with flash attention the core alone keeps only its output, so the   forward
            sublayer is the useful unit
``block``   everything inside the block                                                the block's forward
==========  ========================================================================  ====================

Why ``moe_act`` means ``h_R2F``: what is cheap to rebuild is already never kept — the SwiGLU
output (an elementwise pass over ``h``) and, since the local dispatcher fuses permute, experts
and combine (``ops/local_experts.py``), the dispatched rows (a gather). What the MoE layer still
keeps per layer is ``h_R2F`` (2·F·K/H u; 6u for Qwen3-30B-A3B), the token-order input (1u) and
the residual (1u). Rebuilding ``h_R2F`` costs one grouped GEMM in backward (the
forward's ``x_RH @ w13``: 2 of the experts' 18·T·K·H·F FLOPs per step) — the memory-heavy part at
about a tenth of the experts' time. The dispatched rows ``x_RH`` (K·u) are rebuilt too on the
unfused path (``memory_efficient_permute=False``). Only a single-rank (local) dispatcher is
affected: rows that came through an all-to-all are not cheap to rebuild.

Two mechanisms:

1. *Rebuild on unpack* (``norm``, ``moe_act``): while the block runs forward, a
   ``saved_tensors_hooks`` pair watches what autograd saves. A tensor registered as rebuildable
   (a norm output, the experts' hidden state, the dispatched rows) — or a view of it, or a dtype
   cast of a reshape of it — is replaced by a small token holding the recipe; the unpack hook
   rebuilds it once, shared by all its consumers, right before the first consumer's backward. A rebuild runs the same kernels on
   the same inputs, so values — and therefore losses and gradients — are bitwise identical.
   Tensors the scope does not rebuild go to an enclosing hook pair (e.g. ``CPUOffload``) if any.
2. *Checkpoint* (``moe``, ``attn``, ``block``, and the norms' internals):
   ``torch.utils.checkpoint(use_reentrant=False)``. For regions holding an MoE layer a guard
   makes the recomputed forward see the layer's bookkeeping buffers (expert-bias counts, global
   aux-loss counts) as they were before the original forward, and restores them after, so the
   recompute neither counts tokens twice nor changes the aux-loss gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from lightning_moe.moe.dispatch import DispatchedTokens, DispatcherCapabilities, LocalDispatcher, row_weights
from lightning_moe.moe.layer import MoELayer
from lightning_moe.ops.deferred import resolved
from lightning_moe.ops.expert_bias import bias_rows, expert_of_rows
from lightning_moe.ops.grouped_gemm import gmm, offsets_from_counts
from lightning_moe.ops.permute import Permutation, build_permutation, permute_rows_reference

__all__ = [
    "RECOMPUTE_TARGETS",
    "RecomputePlan",
    "RecomputeScope",
    "RecomputeTarget",
    "guarded_checkpoint",
    "validate_recompute",
]

RecomputeTarget = Literal["norm", "moe_act", "moe", "attn", "block"]
RECOMPUTE_TARGETS: tuple[str, ...] = get_args(RecomputeTarget)

# Autograd nodes whose output is the experts' pre-activation h_R2F = x_TH[src_R] @ w13.
_HIDDEN_PRODUCERS = frozenset({"_PermuteUpBackward"})
# Autograd nodes of ops that only reinterpret a contiguous tensor's shape (element order kept).
_RESHAPE_NODES = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0", "AliasBackward0"})


def validate_recompute(targets: Sequence[str], owner: str = "TransformerConfig") -> tuple[str, ...]:
    """Check a ``recompute`` list; return it as a tuple. Raises ``ValueError`` naming the fix."""
    if isinstance(targets, str):
        raise ValueError(f"{owner}: recompute={targets!r} must be a list of names; write recompute=[{targets!r}].")
    seen: list[str] = []
    for t in targets:
        if t not in RECOMPUTE_TARGETS:
            raise ValueError(f"{owner}: recompute entry {t!r} is unknown; choose from {list(RECOMPUTE_TARGETS)}.")
        if t in seen:
            raise ValueError(f"{owner}: recompute={list(targets)} lists {t!r} twice; list it once.")
        seen.append(t)
    if "block" in seen and len(seen) > 1:
        raise ValueError(
            f"{owner}: recompute={seen} combines 'block' with finer targets, but 'block' already "
            "recomputes everything inside the block; use recompute=['block'] alone."
        )
    if "moe" in seen and "moe_act" in seen:
        raise ValueError(
            f"{owner}: recompute={seen} combines 'moe' with 'moe_act', but 'moe' already recomputes the "
            "whole MoE layer; drop 'moe_act'."
        )
    return tuple(seen)


@dataclass(frozen=True)
class RecomputePlan:
    """The validated ``recompute`` list of one block as flags."""

    norm: bool = False
    moe_act: bool = False
    moe: bool = False
    attn: bool = False
    block: bool = False

    @classmethod
    def from_targets(cls, targets: Sequence[str], owner: str = "TransformerConfig") -> RecomputePlan:
        names = validate_recompute(targets, owner)
        return cls(**{name: True for name in names})

    @property
    def enabled(self) -> bool:
        return self.norm or self.moe_act or self.moe or self.attn or self.block

    def targets(self) -> list[str]:
        return [name for name in RECOMPUTE_TARGETS if getattr(self, name)]


# ----------------------------------------------------------------------------------------------
# checkpoint with a guard for the MoE bookkeeping


def _moe_state(owner: nn.Module) -> list[tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]], dict[str, Any]]]:
    """Clones of every buffer inside each MoE layer under ``owner``, and its ``last_*`` hooks."""
    state = []
    for layer in owner.modules():
        if isinstance(layer, MoELayer):
            buffers = [(b, b.detach().clone()) for b in layer.buffers()]
            published = {k: v for k, v in vars(layer).items() if k.startswith("last_")}
            state.append((layer, buffers, published))
    return state


@torch.no_grad()
def _restore(state: list[tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]], dict[str, Any]]]) -> None:
    for layer, buffers, published in state:
        for buf, saved in buffers:
            buf.copy_(saved)  # in place: CUDA graphs and optimizers may hold the buffer's address
        for key, value in published.items():
            setattr(layer, key, value)


def guarded_checkpoint(owner: nn.Module, fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """``checkpoint(fn, *args, use_reentrant=False)`` that keeps MoE bookkeeping exact.

    Forward side effects of the MoE layers under ``owner`` (``+=`` on expert-bias and global
    aux-loss counts, the ``last_*`` attributes) happen once: the recomputation in backward starts
    from the buffers as they were before the original forward, and leaves them as they were after.
    """
    before = _moe_state(owner)
    calls = [0]

    def run(*inner: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 1 or not before:
            return fn(*inner)
        after = _moe_state(owner)
        _restore(before)
        try:
            return fn(*inner)
        finally:  # also when checkpoint stops the recomputation early
            _restore(after)

    return checkpoint(run, *args, use_reentrant=False)


# ----------------------------------------------------------------------------------------------
# rebuild on unpack


class _Rebuild:
    """One rebuildable tensor: its recipe, and the rebuilt value while consumers still need it."""

    def __init__(self, recipe: Callable[[], torch.Tensor], like: torch.Tensor) -> None:
        self.recipe = recipe
        self.numel = like.numel()
        self.dtype = like.dtype
        self.pending = 0  # tokens packed and not yet unpacked
        self.value: torch.Tensor | None = None
        self.on_first_pack: Callable[[], None] | None = None

    def packed(self) -> None:
        if self.pending == 0 and self.on_first_pack is not None:
            self.on_first_pack()
            self.on_first_pack = None
        self.pending += 1

    def get(self) -> torch.Tensor:
        if self.value is None:
            self.value = self.recipe()
        return self.value

    def release(self) -> None:
        self.pending -= 1
        if self.pending <= 0:
            self.value = None


@dataclass
class _Token:
    """What autograd holds instead of a rebuildable tensor (a view of it, or a cast reshape)."""

    entry: _Rebuild
    size: torch.Size
    stride: tuple[int, ...] | None  # None: ``reshape(size).to(cast)``
    offset: int
    cast: torch.dtype | None


@dataclass
class _Delegated:
    """A tensor handed to the enclosing saved-tensor hooks (e.g. CPUOffload's)."""

    unpack: Callable[[Any], torch.Tensor]
    payload: Any


def _covers_storage(t: torch.Tensor) -> bool:
    """Contiguous from offset 0 over its whole storage, so any view maps back by ``as_strided``."""
    return (
        t.is_contiguous() and t.storage_offset() == 0 and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor with a storage (not a subclass such as DTensor, not sparse)."""
    return (type(t) is torch.Tensor or type(t) is nn.Parameter) and t.layout == torch.strided


def _norm_recipe(norm: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def rebuild() -> torch.Tensor:
        # Same grad mode and requires_grad as the forward, so the same kernels run.
        with torch.enable_grad():
            return norm(x.detach().requires_grad_(x.requires_grad)).detach()

    return rebuild


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Token):
        full = packed.entry.get()
        if packed.cast is None:
            out = full.as_strided(packed.size, packed.stride, packed.offset)  # type: ignore[arg-type]
        else:
            out = full.reshape(packed.size).to(packed.cast)
        packed.entry.release()
        return out
    if isinstance(packed, _Delegated):
        return packed.unpack(packed.payload)
    return packed


class _MoEActDispatcher:
    """Stands in for a :class:`LocalDispatcher` during one MoE forward under ``moe_act``.

    Fused path (``run_experts``): the same permutation and expert call as the dispatcher's, with
    the scope told which saved tensor is the experts' hidden state and how to rebuild it.
    Unfused path (``dispatch``): the dispatched rows are registered for a re-gather.
    """

    def __init__(self, inner: LocalDispatcher, scope: RecomputeScope) -> None:
        self.inner = inner
        self.scope = scope
        self.num_local_experts = inner.num_local_experts
        # run_experts as the inner one has it, but without the router's permutation (this one builds
        # its own, to announce the hidden state); never wrapped twice.
        self.capabilities = DispatcherCapabilities(runs_experts=inner.capabilities.runs_experts)

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, capacity: int | None
    ) -> tuple[DispatchedTokens, Any]:
        dispatched, handle = self.inner.dispatch(x_TH, topk_ids_TK, topk_weights_TK, capacity)
        self.scope.register_gather(dispatched.x_RH, x_TH, handle.perm.src_token_R)
        return dispatched, handle

    def combine(self, y_RH: torch.Tensor, handle: Any, weighted: bool) -> torch.Tensor:
        return self.inner.combine(y_RH, handle, weighted)

    def run_experts(
        self,
        x_TH: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        topk_weights_TK: torch.Tensor,
        capacity: int | None,
        experts: nn.Module,
    ) -> torch.Tensor:
        # LocalDispatcher.run_experts, with the hidden state announced to the scope.
        perm = build_permutation(topk_ids_TK, self.inner.num_experts, capacity, self.inner.dropless)
        w_R = row_weights(resolved(topk_weights_TK), perm, self.inner.dropless and capacity is None)
        self.scope.expect_expert_hidden(experts, x_TH, perm)
        lean = experts.lean_backward
        experts.lean_backward = True  # rebuild x_RH and a_RF too, instead of saving them
        try:
            return experts.forward_local(x_TH, perm, w_R)  # type: ignore[operator]
        finally:
            experts.lean_backward = lean
            self.scope.expected_hidden = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _hidden_recipe(
    experts: nn.Module, source: Callable[[], torch.Tensor], perm: Permutation, dtype: torch.dtype
) -> Callable[[], torch.Tensor]:
    """``h_R2F = gmm(x_TH[src_R], w13) (+ b13)``, exactly as ``GroupedExperts.forward_local`` computes it."""

    def rebuild() -> torch.Tensor:
        w13 = experts.w13
        w13 = (w13.to_local() if isinstance(w13, DTensor) else w13).to(dtype)
        x_TH = source().to(dtype)
        backend = experts.gemm_backend(x_TH.device, dtype)  # type: ignore[operator]
        x_RH = permute_rows_reference(x_TH, perm.src_token_R)  # a gather: the same bits as the kernel's
        with torch.no_grad():
            offs = offsets_from_counts(perm.tokens_per_expert_E)
            h_R2F = gmm(x_RH, w13, offs, backend, experts.gemm_kernel, experts.gemm_tile)  # type: ignore[arg-type]
            b13 = getattr(experts, "b13", None)
            if b13 is not None:
                b13 = (b13.to_local() if isinstance(b13, DTensor) else b13).to(dtype)
                h_R2F.add_(bias_rows(b13, expert_of_rows(offs, x_RH.shape[0])))
            return h_R2F

    return rebuild


@dataclass
class _ExpectedHidden:
    """The experts' hidden state a fused expert call is about to save: its shape and recipe."""

    rows: int
    cols: int
    recipe_for: Callable[[torch.dtype], Callable[[], torch.Tensor]]
    source_entry: _Rebuild | None


class RecomputeScope:
    """Context for one block forward: applies a :class:`RecomputePlan` to its parts.

    Stages the block calls, in order: :meth:`norm` (attention norm), :meth:`attention`,
    :meth:`norm` (FFN norm), :meth:`ffn`. With no target (or grad disabled) each is a plain call.
    """

    def __init__(self, plan: RecomputePlan) -> None:
        self.plan = plan
        self.active = plan.enabled and not plan.block and torch.is_grad_enabled()
        self._hooks = self.active and (plan.norm or plan.moe_act)
        self._by_storage: dict[int, tuple[_Rebuild, torch.Tensor]] = {}
        self._by_node: dict[Any, _Rebuild] = {}
        self._outer: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None
        self.expected_hidden: _ExpectedHidden | None = None

    def __enter__(self) -> RecomputeScope:
        if self._hooks:
            top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
            self._outer = top(False) if top is not None else None
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack, _unpack)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        # Tokens keep what they need; the registry (and the autograd nodes it names) goes.
        self._by_storage.clear()
        self._by_node.clear()
        self._outer = None

    # --- the block's parts ---------------------------------------------------------------------

    def norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not (self.active and self.plan.norm):
            return norm(x)
        # The checkpoint keeps only x (which the residual stream holds anyway) for the norm's own
        # backward; the output is registered so that its consumers do not keep it either.
        y = checkpoint(norm, x, use_reentrant=False)
        self._register(y, _norm_recipe(norm, x))
        return y

    def attention(self, attn: nn.Module, h: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        if self.active and self.plan.attn:
            return checkpoint(attn, h, *args, use_reentrant=False)
        return attn(h, *args)

    def ffn(self, ffn: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if self.active and self.plan.moe:
            return guarded_checkpoint(ffn, ffn, h)
        if (
            self.active
            and self.plan.moe_act
            and isinstance(ffn, MoELayer)
            and ffn.dispatcher.capabilities.rows_cheap_to_rebuild  # rows from an all-to-all are not cheap
        ):
            inner = ffn.dispatcher
            ffn.dispatcher = _MoEActDispatcher(inner, self)  # type: ignore[assignment]
            try:
                return ffn(h)
            finally:
                ffn.dispatcher = inner
        return ffn(h)

    # --- registry ------------------------------------------------------------------------------

    def _register(self, y: torch.Tensor, recipe: Callable[[], torch.Tensor]) -> _Rebuild | None:
        if not (_plain(y) and y.requires_grad and _covers_storage(y)):
            return None
        entry = _Rebuild(recipe, y)
        # The tensor itself is held only while the scope is open, so its storage address cannot be
        # reused by another tensor while it is a registry key.
        self._by_storage[y.untyped_storage().data_ptr()] = (entry, y)
        if y.grad_fn is not None:
            self._by_node[y.grad_fn] = entry
        return entry

    def _source(self, x_TH: torch.Tensor) -> tuple[Callable[[], torch.Tensor], _Rebuild | None]:
        """How a recipe gets ``x_TH`` back: through its own rebuild (a norm output), or held."""
        norm_entry = self._lookup_storage(x_TH)
        if norm_entry is not None:
            shape = x_TH.shape

            def rebuilt() -> torch.Tensor:
                value = norm_entry.get().reshape(shape)
                norm_entry.release()
                return value

            return rebuilt, norm_entry
        kept_TH = x_TH.detach()
        return (lambda: kept_TH), None

    def register_gather(self, x_RH: torch.Tensor, x_TH: torch.Tensor, src_R: torch.Tensor) -> None:
        """``x_RH = x_TH[src_R]``: rebuild it by a gather instead of saving it."""
        source, norm_entry = self._source(x_TH)
        entry = self._register(x_RH, lambda: permute_rows_reference(source(), src_R))
        if entry is not None and norm_entry is not None:
            entry.on_first_pack = norm_entry.packed

    def expect_expert_hidden(self, experts: nn.Module, x_TH: torch.Tensor, perm: Permutation) -> None:
        """The next saved ``[R, 2F]`` hidden state of the fused experts is ``gmm(x_TH[src_R], w13)``."""
        source, norm_entry = self._source(x_TH)
        self.expected_hidden = _ExpectedHidden(
            rows=perm.num_rows,
            cols=experts.w13.shape[-1],  # type: ignore[union-attr]
            recipe_for=lambda dtype: _hidden_recipe(experts, source, perm, dtype),
            source_entry=norm_entry,
        )

    def _hidden_token(self, t: torch.Tensor) -> _Token | None:
        spec = self.expected_hidden
        if (
            spec is None
            or t.dim() != 2
            or tuple(t.shape) != (spec.rows, spec.cols)
            or not t.dtype.is_floating_point
            or not _covers_storage(t)
        ):
            return None
        # ``h_R2F`` is internal to one fused node (no autograd history) or the output of
        # ``ops/local_experts.py``'s ``_PermuteUp``; any other [R, 2F] tensor is left alone.
        node = t.grad_fn
        if not (node is None and not t.requires_grad) and type(node).__name__ not in _HIDDEN_PRODUCERS:
            return None
        self.expected_hidden = None  # one hidden state per expert call
        entry = _Rebuild(spec.recipe_for(t.dtype), t)
        if spec.source_entry is not None:
            entry.on_first_pack = spec.source_entry.packed
        entry.packed()
        return _Token(entry, t.size(), t.stride(), t.storage_offset(), None)

    def _lookup_storage(self, t: torch.Tensor) -> _Rebuild | None:
        if not _plain(t):
            return None
        hit = self._by_storage.get(t.untyped_storage().data_ptr())
        if hit is None or hit[0].dtype != t.dtype or not t.is_contiguous() or t.storage_offset() != 0:
            return None
        return hit[0] if t.numel() == hit[0].numel else None

    def _pack(self, t: torch.Tensor) -> Any:
        if self.expected_hidden is not None and _plain(t):
            token = self._hidden_token(t)
            if token is not None:
                return token
        if self._by_storage and _plain(t):
            hit = self._by_storage.get(t.untyped_storage().data_ptr())
            if hit is not None and hit[0].dtype == t.dtype:
                hit[0].packed()
                return _Token(hit[0], t.size(), t.stride(), t.storage_offset(), None)
            entry = self._cast_of_registered(t)
            if entry is not None:
                entry.packed()
                return _Token(entry, t.size(), None, 0, t.dtype)
        if self._outer is not None:
            return _Delegated(self._outer[1], self._outer[0](t))
        return t

    def _cast_of_registered(self, t: torch.Tensor) -> _Rebuild | None:
        """``t = registered.reshape(...).to(dtype)`` (the router's fp32 copy of its input)?"""
        node = t.grad_fn
        if node is None or node.name() != "ToCopyBackward0" or not t.is_contiguous():
            return None
        src = node.next_functions[0][0]
        if src is not None and src.name() in _RESHAPE_NODES:
            src = src.next_functions[0][0]
        entry = self._by_node.get(src) if src is not None else None
        return entry if entry is not None and entry.numel == t.numel() else None
