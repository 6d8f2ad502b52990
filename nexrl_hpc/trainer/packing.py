"""Padding-free forward passes: sequences packed into rows, micro-batches cut by a token budget.

A training batch is padded to its longest prompt (left) and longest response (right): with
responses of 16 to 512 tokens most of a padded batch is padding, and every layer computes on it.
Packing lays the sequences' real tokens end to end instead — first-fit into rows as wide as the
micro-batch's longest sequence — with position ids restarting at each sequence. The model is
called with no attention mask, so transformers builds the block-diagonal causal mask from the
position ids (SDPA / eager on CPU) or runs varlen flash attention (``flash_attention_2`` on GPU):
each token attends to its own sequence only, exactly as in the padded batch.

Only token positions move: the logits predicting each response token are gathered back to the
``[rows, response_len]`` layout the losses use, so every loss and aggregation mode is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def micro_batch_ranges(lengths: list[int], max_rows: int, max_tokens: int | None) -> list[tuple[int, int]]:
    """Consecutive row ranges [a, b) of one rank's mini-batch slice: ``max_rows`` rows each, or,
    with ``max_tokens``, as many rows as fit that many real tokens (a longer row goes alone)."""
    ranges: list[tuple[int, int]] = []
    start = 0
    tokens = 0
    for i, n in enumerate(lengths):
        full = (i - start >= max_rows) if max_tokens is None else (i > start and tokens + n > max_tokens)
        if full:
            ranges.append((start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        ranges.append((start, len(lengths)))
    return ranges


def first_fit_bins(lengths: list[int], width: int) -> list[list[int]]:
    """Rows (indices into ``lengths``) packed into bins of ``width`` tokens, first fit in decreasing
    length: within a few bins of the fewest possible, so little is left for padding."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        slot = next((k for k, room in enumerate(free) if room >= lengths[i]), None)
        if slot is None:
            bins.append([])
            free.append(width)
            slot = len(bins) - 1
        bins[slot].append(i)
        free[slot] -= lengths[i]
    return bins


def plan_micro_batches(
    lengths: list[int], max_rows: int, max_tokens: int | None, packing: bool
) -> list[list[list[int]]]:
    """One rank's mini-batch slice as micro-batches, each a list of bins of row indices.

    Padded: consecutive rows (``micro_batch_ranges``), one row per bin. Packed: the whole slice is
    packed first (bins as wide as its longest sequence), then consecutive bins form micro-batches of
    at most ``max_tokens`` real tokens (or ``max_rows`` rows) — packing the slice rather than each
    micro-batch leaves fewer, fuller bins.
    """
    if not packing:
        return [[[i] for i in range(a, b)] for a, b in micro_batch_ranges(lengths, max_rows, max_tokens)]
    bins = first_fit_bins(lengths, max(lengths, default=1))
    sizes = [sum(lengths[i] for i in b) if max_tokens is not None else len(b) for b in bins]
    limit = max_tokens if max_tokens is not None else max_rows
    micro: list[list[list[int]]] = []
    used = 0
    for b, size in zip(bins, sizes):
        if micro and used + size <= limit:
            micro[-1].append(b)
            used += size
        else:
            micro.append([b])
            used = size
    return micro


@dataclass
class PackedSequences:
    """Rows of packed sequences and where each response token's logit sits in them."""

    input_ids: torch.Tensor  # [bins, width]
    position_ids: torch.Tensor  # [bins, width], restarting at every sequence
    bin_row: torch.Tensor  # [N] for every real response token: its packed row ...
    bin_col: torch.Tensor  # [N] ... and the column of the logit that predicts it
    seq: torch.Tensor  # [N] its row in the padded batch ...
    pos: torch.Tensor  # [N] ... and its response position


def pack_sequences(
    micro: dict[str, torch.Tensor], bins: list[list[int]] | None = None, pad_token_id: int = 0
) -> PackedSequences:
    """Pack a padded micro-batch (``input_ids``, ``attention_mask``, ``position_ids``, ``responses``)
    into ``bins`` (lists of its row indices; None: first fit here)."""
    input_ids, attention, positions = micro["input_ids"], micro["attention_mask"], micro["position_ids"]
    rows, width = input_ids.shape
    prompt_width = width - micro["responses"].shape[1]
    real = attention.bool()
    lengths = real.sum(-1).tolist()
    starts = real.int().argmax(-1).tolist()  # first real column (prompts are left-padded)
    response_lengths = real[:, prompt_width:].sum(-1).tolist()
    for b in range(rows):
        n, s = lengths[b], starts[b]
        if n and not bool(real[b, s : s + n].all()):
            raise ValueError(f"row {b} of the micro-batch has padding inside its tokens: it cannot be packed")
        if response_lengths[b] and s >= prompt_width:
            raise ValueError(
                f"row {b} of the micro-batch has a response but no prompt token to predict it from"
            )
    if bins is None:
        bins = first_fit_bins(lengths, max(max(lengths), 1))
    bin_width = max(max(sum(lengths[b] for b in members) for members in bins), 1)
    packed_ids = torch.full((len(bins), bin_width), pad_token_id, dtype=input_ids.dtype)
    packed_pos = torch.zeros((len(bins), bin_width), dtype=positions.dtype)
    bin_row, bin_col, seq, pos = [], [], [], []
    for k, members in enumerate(bins):
        offset = 0
        for b in members:
            n, s = lengths[b], starts[b]
            packed_ids[k, offset : offset + n] = input_ids[b, s : s + n]
            packed_pos[k, offset : offset + n] = positions[b, s : s + n]
            r = response_lengths[b]
            # response token j sits at padded column prompt_width + j; the logit before it predicts it
            first = offset + (prompt_width - 1 - s)
            bin_row.append(torch.full((r,), k))
            bin_col.append(torch.arange(first, first + r))
            seq.append(torch.full((r,), b))
            pos.append(torch.arange(r))
            offset += n
        # the row's tail is padding: a sequence of its own (positions restart), attended by nothing real
        packed_pos[k, offset:] = torch.arange(bin_width - offset)
    empty = torch.zeros(0, dtype=torch.long)
    return PackedSequences(
        packed_ids,
        packed_pos,
        torch.cat(bin_row) if bin_row else empty,
        torch.cat(bin_col) if bin_col else empty,
        torch.cat(seq) if seq else empty,
        torch.cat(pos) if pos else empty,
    )


def packed_response_log_probs_and_entropy(
    model: Any,
    micro: dict[str, torch.Tensor],
    with_entropy: bool,
    entropy_grad: bool,
    bins: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(response token | prefix) and (``with_entropy``) the policy's entropy at every response
    position, both [rows, response_len] in fp32 and 0 past each response, from one packed forward."""
    packed = pack_sequences(micro, bins)
    device = micro["input_ids"].device
    out = model(
        input_ids=packed.input_ids.to(device),
        attention_mask=None,  # the position ids carry the sequence boundaries
        position_ids=packed.position_ids.to(device),
        use_cache=False,
    )
    logits = out.logits[packed.bin_row.to(device), packed.bin_col.to(device)]  # [N, V]
    log_p = torch.log_softmax(logits.float(), dim=-1)
    seq, pos = packed.seq.to(device), packed.pos.to(device)
    shape = micro["responses"].shape
    tokens = micro["responses"][seq, pos]
    logp = torch.zeros(shape, dtype=torch.float32, device=device).index_put(
        (seq, pos), log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    )
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        token_entropy = -(log_p.exp() * log_p).sum(-1)
        entropy = torch.zeros(shape, dtype=torch.float32, device=device).index_put((seq, pos), token_entropy)
    return logp, entropy
