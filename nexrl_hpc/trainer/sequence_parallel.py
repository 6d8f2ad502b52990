"""Ulysses sequence parallelism: the ranks of one group split every sequence, attention splits the heads.

``service.train_service.sequence_parallel_size`` = P > 1 cuts the trainer group's ranks into groups
of P consecutive ranks. The ranks of one group get the same rows (the batch plan gives them one
data-parallel shard) and each runs the model on 1/P of every row's tokens: embeddings, MLPs and
norms see S/P tokens. Attention needs the whole sequence: an all-to-all turns the local
``[B, heads, S/P, d]`` queries, keys and values into ``[B, heads/P, S, d]`` (gather the sequence,
scatter the heads), the model's own attention (sdpa, eager or flash) runs on that, and the inverse
all-to-all brings ``[B, S/P, heads, d]`` back. Nothing of the model's code is copied: the wrapper is
an attention function registered in transformers' ``AttentionInterface`` under
``nexrl_ulysses_<inner>`` and named in the model config's ``_attn_implementation``.

- Masks: the model sees a custom attention name, so it builds no mask of its own; the wrapper
  builds it once per forward on the whole (gathered) sequence: causal and key padding from the
  2-D attention mask when there is one (padded rows), causal within each sequence of a packed row
  otherwise (a sequence starts where the position ids do not go up by one, as transformers detects
  packing). Every token also sees itself, so a padding row is never fully masked.
- Position ids are the whole sequence's, split with the tokens: rotary embeddings are unchanged.
- Grouped-query attention: K/V heads are replicated (``repeat_interleave``) by the smallest factor
  that makes them divisible by P, so a model with fewer KV heads than P works (1 KV head, P=2:
  each rank gets a copy). Query heads must divide by P (pre-flight refuses otherwise).
- The last hidden states are all-gathered along the sequence, so the LM head and the log-probs
  (whatever computes them) see whole rows; the gather's backward sums the P ranks' gradients
  and keeps this rank's slice. Each rank of a group thus computes the group's loss and the gradient
  summed over the group's ranks is P times that loss's: the data-parallel loss scale is
  world / P (``ParallelStrategy.loss_scale``) and the loss sums are divided by P.

The head and log-prob stage runs on the whole sequence on each rank of a group (its memory is
bounded by the log-prob computation, not by P); the decoder layers' activations per rank are
those of S/P tokens (``tokens_per_rank``).
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

ATTENTION_PREFIX = "nexrl_ulysses_"
KEY = "service.train_service.sequence_parallel_size"
_HOLDER = "_nexrl_sequence_parallel"  # the attribute of every module of the model that reads its config


def tokens_per_rank(tokens: int, sequence_parallel_size: int) -> int:
    """Tokens of a row of ``tokens`` that one rank's decoder layers compute (rows are padded to a
    multiple of P): what a per-rank memory estimate of the layers' activations takes. The
    attention of a rank covers the whole row for heads / P of the heads; the LM head and the
    log-probs cover the whole row."""
    return -(-tokens // sequence_parallel_size)


def kv_repeat(kv_heads: int, size: int) -> int:
    """Copies of each K/V head so that their count divides by ``size`` (1 when it already does)."""
    return math.lcm(kv_heads, size) // kv_heads


def new_sequence_parallel_group(size: int) -> tuple[Any, int]:
    """(process group of this rank's P consecutive ranks, this rank's index in it). Every rank
    of the default group must call it (each group is created collectively)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"{KEY}={size} must divide the trainer group's {world} rank(s)")
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return mine, rank % size


class _AllToAll(torch.autograd.Function):
    """Split ``x`` along ``scatter_dim`` into P chunks, chunk j to rank j; concatenate what arrives
    along ``gather_dim`` (rank order). Its backward is the same exchange with the dims swapped."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Any, size: int, scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.size, ctx.dims = group, size, (scatter_dim, gather_dim)
        return _all_to_all(x, group, size, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, ctx.size, gather_dim, scatter_dim), None, None, None, None


class EmulatedGroup:
    """Stands for the other ranks of a group in one process (``emulate_sequence_parallel``): what
    would arrive from them is a copy of this rank's own data, of the same shapes."""


def _all_to_all(x: torch.Tensor, group: Any, size: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    if isinstance(group, EmulatedGroup):  # rank 0: every rank's chunk 0 is a copy of its own
        return torch.cat([send[0].clone() for _ in range(size)], dim=gather_dim)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather ``[B, s, h]`` slices into ``[B, P*s, h]``; backward: the gradients of the P ranks
    summed, this rank's slice kept (every rank of a group computes the same loss from the result)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.size, ctx.rank = group, size, rank
        if isinstance(group, EmulatedGroup):
            return torch.cat([x.clone() for _ in range(size)], dim=1)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous().clone()  # reduced in place: not the caller's tensor
        if not isinstance(ctx.group, EmulatedGroup):
            dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=1)[ctx.rank].contiguous(), None, None, None


@dataclass
class _ForwardState:
    """One forward's whole-sequence inputs (what the attention's mask is built from)."""

    position_ids: torch.Tensor  # [B, S_padded]
    padding_mask: torch.Tensor | None  # [B, S_padded] bool (padded rows); None: packed, by position ids
    length: int  # S before padding to a multiple of P
    masks: dict[Any, torch.Tensor] = field(default_factory=dict)  # built once per forward and kind
    causal: bool | None = None  # every row one sequence, no padding: sdpa needs no mask

    def mask(self, kind: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The attention mask of the inner implementation ``kind`` on the whole sequence."""
        if kind.startswith("flash"):  # varlen from the position ids, or the 2-D padding mask
            return None if self.padding_mask is None else self.padding_mask.to(device, torch.int32)
        if kind == "sdpa" and self.causal_only():
            return None  # sdpa's is_causal: no [B, S, S] mask
        key = (kind, dtype, device)
        if key not in self.masks:
            allowed = whole_sequence_mask(self.position_ids, self.padding_mask).to(device)[:, None]
            if kind == "sdpa":
                self.masks[key] = allowed
            else:  # eager adds it to the scores
                self.masks[key] = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
                    ~allowed, torch.finfo(dtype).min
                )
        return self.masks[key]

    def causal_only(self) -> bool:
        """Whether a causal mask is the whole story: no padding and one sequence per row before the
        tail that pads the rows to a multiple of P (it sees only earlier tokens and is cut off)."""
        if self.causal is None:
            real = slice(0, self.length)
            if self.padding_mask is not None:  # transformers detects no packing beside a 2-D mask
                self.causal = bool(self.padding_mask[:, real].all())
            else:
                self.causal = bool((torch.diff(self.position_ids[:, real], dim=-1) == 1).all())
        return self.causal


def whole_sequence_mask(position_ids: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
    """[B, S, S] who attends to whom: causal and key padding (``padding_mask``), or causal within
    each packed sequence (a new one where the position ids do not go up by one); the diagonal always."""
    width = position_ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=position_ids.device).tril()[None]
    if padding_mask is not None:
        allowed = causal & padding_mask.bool()[:, None, :]
    else:
        first = position_ids[:, :1] - 1
        sequence = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
        allowed = causal & (sequence[:, :, None] == sequence[:, None, :])
    return allowed | torch.eye(width, dtype=torch.bool, device=position_ids.device)[None]


class _GroupedHeads:
    """The attention module as the inner implementation sees it after the all-to-all: the local
    query heads per (replicated) K/V head differ from the module's when K/V heads were replicated,
    and its config names the inner implementation (flash attention picks its kernel by it)."""

    def __init__(self, module: Any, groups: int, config: Any) -> None:
        self._module = module
        self.num_key_value_groups = groups
        self.config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class SequenceParallel:
    """One model's sequence parallelism: its group, the hooks that split and gather, the state of
    the forward in flight (kept until the next forward: activation checkpointing recomputes)."""

    def __init__(self, group: Any, size: int, rank: int, inner_config: Any = None) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.inner_config = inner_config  # the model's config naming the wrapped implementation
        self.state: _ForwardState | None = None

    def split_inputs(self, _module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """The base model's forward pre-hook: this rank's slice of the tokens and position ids."""
        if args:
            raise TypeError("sequence parallelism: call the model with keyword arguments")
        tokens = kwargs.get("input_ids")
        embeds = kwargs.get("inputs_embeds")
        source = tokens if tokens is not None else embeds
        assert source is not None, "the model got neither input_ids nor inputs_embeds"
        rows, length = source.shape[:2]
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=source.device).expand(rows, length)
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ValueError(
                f"{KEY} > 1 takes no custom 4-D attention mask (service.train_service.actor.share_prompt=true)"
            )
        pad = -length % self.size
        if pad:  # a tail of its own: restarting positions, masked as keys
            positions = torch.cat(
                [positions, torch.arange(pad, device=positions.device).expand(rows, pad)], 1
            )
            if mask is not None:
                mask = torch.cat([mask, mask.new_zeros(rows, pad)], 1)
        self.state = _ForwardState(positions, None if mask is None else mask.bool(), length)
        width = (length + pad) // self.size
        cut = slice(self.rank * width, (self.rank + 1) * width)
        kwargs = dict(kwargs, position_ids=positions[:, cut], attention_mask=None)
        if tokens is not None:
            kwargs["input_ids"] = torch.nn.functional.pad(tokens, (0, pad))[:, cut]
        else:
            assert embeds is not None
            kwargs["inputs_embeds"] = torch.nn.functional.pad(embeds, (0, 0, 0, pad))[:, cut]
        return (), kwargs

    def gather_outputs(self, _module: Any, _args: tuple, _kwargs: dict[str, Any], output: Any) -> Any:
        """The base model's forward hook: the last hidden states of the whole rows."""
        assert self.state is not None
        hidden = _GatherSequence.apply(output["last_hidden_state"], self.group, self.size, self.rank)
        output["last_hidden_state"] = hidden[:, : self.state.length]
        return output

    def attention(
        self,
        inner: Callable[..., Any],
        kind: str,
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """Gather the sequence and scatter the heads, run ``inner`` on the whole sequence, undo."""
        state = self.state
        assert state is not None, "sequence parallel attention outside a forward of its model"
        repeat = kv_repeat(key.shape[1], self.size)
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        query, key, value = (_AllToAll.apply(t, self.group, self.size, 1, 2) for t in (query, key, value))
        mask = state.mask(kind, query.dtype, query.device)
        kwargs = dict(kwargs, position_ids=state.position_ids.to(query.device))
        proxy = _GroupedHeads(module, query.shape[1] // key.shape[1], self.inner_config)
        out, _ = inner(proxy, query, key, value, mask, **kwargs)  # [B, S, heads / P, d]
        return _AllToAll.apply(out, self.group, self.size, 1, 2), None


def _inner_attention(kind: str, module: Any) -> Callable[..., Any]:
    """The implementation the wrapper runs: a registered one, or the model's own eager function."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if kind != "eager":
        return ALL_ATTENTION_FUNCTIONS[kind]
    for cls in type(module).__mro__:
        eager = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if eager is not None:
            return eager
    raise ValueError(f"{type(module).__name__}: no eager_attention_forward in its module to wrap")


def _register(kind: str) -> str:
    """Register the wrapper around ``kind`` (idempotent); its name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    name = ATTENTION_PREFIX + kind
    if name in ALL_ATTENTION_FUNCTIONS:
        return name

    def ulysses(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        sp = getattr(module, _HOLDER, None)
        if sp is None:
            raise RuntimeError(f"attention {name!r} on a model without sequence parallelism enabled")
        return sp.attention(_inner_attention(kind, module), kind, module, query, key, value, **kwargs)

    AttentionInterface.register(name, ulysses)
    assert name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping  # no mask of the model's own
    return name


def enable_sequence_parallel(model: Any, group: Any, size: int, rank: int) -> SequenceParallel:
    """Split ``model``'s sequences over the ``size`` ranks of ``group`` (this rank: ``rank``)."""
    from nexrl_hpc.trainer.packing import hf_config

    config = hf_config(model)
    heads = config.num_attention_heads
    if heads % size:
        raise ValueError(f"{KEY}={size} must divide the model's {heads} attention heads")
    kind = config._attn_implementation or "eager"
    if kind.startswith(ATTENTION_PREFIX):
        raise ValueError("sequence parallelism is already enabled on this model")
    if kind not in ("eager", "sdpa") and not kind.startswith("flash_attention"):
        raise ValueError(
            f"{KEY} > 1 wraps eager, sdpa or flash attention, not model.attn_implementation={kind}"
        )
    # the decoder: under a LoRA policy's PeftModel, of the causal LM it wraps
    causal_lm = model.get_base_model() if hasattr(model, "peft_config") else model
    base = getattr(causal_lm, "model", None)
    if base is None:
        raise ValueError(f"{KEY} > 1 needs an HF causal LM with its decoder at .model")
    inner_config = copy.copy(config)  # shallow: the wrapped implementation's name on a copy
    inner_config._attn_implementation_internal = kind
    sp = SequenceParallel(group, size, rank, inner_config)
    for module in model.modules():
        if getattr(module, "config", None) is config:
            setattr(module, _HOLDER, sp)
    base.register_forward_pre_hook(sp.split_inputs, with_kwargs=True)
    base.register_forward_hook(sp.gather_outputs, with_kwargs=True)
    config._attn_implementation = _register(kind)
    return sp


def emulate_sequence_parallel(model: Any, size: int) -> SequenceParallel:
    """Rank 0 of a group of ``size`` in this one process, without torch.distributed: the other
    ranks' tokens are stand-ins (copies of this rank's), so the values past this rank's slice are
    not the model's, but every tensor has the shape it has on a real rank. For a per-rank memory
    measurement (peak of a training micro-step at ``sequence_parallel_size=size``) on one machine."""
    return enable_sequence_parallel(model, EmulatedGroup(), size, 0)
