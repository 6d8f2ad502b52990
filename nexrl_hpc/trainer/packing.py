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

Sharing prompts (``actor.share_prompt``) goes one step further for GRPO-style groups, whose n
samples repeat one prompt: the rows with one prompt (a family) are packed as that prompt once,
then each row's response, and a 4-D mask lets every response attend to the prompt and to itself
(causally) only. The prompt's hidden states are the same in every row of the family, so the
log-probs and gradients are those of the padded batch while the prompt is computed once instead
of n times. Custom masks need eager or SDPA attention (not flash_attention_2).

Sharing pays when prompts outweigh responses; with long responses a family packed into one row
makes attention quadratic in the whole family's width and loses (responses of 16-512 tokens:
0.77x of padded). ``share_prompt=auto`` decides per batch: it plans the batch both ways and shares
when the estimated forward FLOPs (``forward_costs``, ``plan_cost``) are lower.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from nexrl_hpc.trainer.logprobs import scores_through_head


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
    return consecutive_micro_batches(bins, sizes, limit)


def consecutive_micro_batches(bins: list[list[int]], sizes: list[int], limit: int) -> list[list[list[int]]]:
    """Consecutive bins grouped while their ``sizes`` (tokens or rows) sum to at most ``limit``; a
    bin over the limit goes alone."""
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


def plan_shared_prompt_micro_batches(
    prompt_keys: list[bytes],
    prompt_lengths: list[int],
    lengths: list[int],
    max_rows: int,
    max_tokens: int | None,
) -> list[list[list[int]]]:
    """One rank's mini-batch slice as micro-batches of bins, a bin holding whole families (rows with
    one prompt, ``prompt_keys``), each computed as its prompt once plus every row's response.

    A family larger than the usual one (two groups drew the same prompt) is cut into families of
    the usual size, so that one does not set the width of every bin; the families are then packed
    first fit into bins as wide as the widest, and consecutive bins form micro-batches of at most
    ``max_tokens`` computed tokens or ``max_rows`` rows (a bin over the limit goes alone)."""
    families: dict[bytes, list[int]] = {}
    for i, key in enumerate(prompt_keys):
        families.setdefault(key, []).append(i)
    if not families:
        return []
    counts = Counter(len(f) for f in families.values())
    usual = max(counts, key=lambda size: (counts[size], size))
    chunks = [f[i : i + usual] for f in families.values() for i in range(0, len(f), usual)]
    widths = [prompt_lengths[c[0]] + sum(lengths[i] - prompt_lengths[i] for i in c) for c in chunks]
    packed = first_fit_bins(widths, max(widths))  # bins of chunk indices
    bins = [[row for c in members for row in chunks[c]] for members in packed]
    if max_tokens is not None:
        sizes, limit = [sum(widths[c] for c in members) for members in packed], max_tokens
    else:
        sizes, limit = [len(b) for b in bins], max_rows
    return consecutive_micro_batches(bins, sizes, limit)


def forward_costs(model_config: Any) -> tuple[float, float]:
    """(FLOPs per token, FLOPs per attending token pair) of one forward pass, from the model's HF
    config: the weight matmuls (projections, MLP, LM head) grow with tokens, attention (dense on
    CPU/SDPA: a mask does not skip work) with each row's width squared."""
    hidden = int(model_config.hidden_size)
    layers = int(model_config.num_hidden_layers)
    heads = int(getattr(model_config, "num_attention_heads", 1) or 1)
    kv_dim = hidden * int(getattr(model_config, "num_key_value_heads", heads) or heads) // heads
    intermediate = int(getattr(model_config, "intermediate_size", 4 * hidden) or 4 * hidden)
    per_layer = hidden * (2 * hidden + 2 * kv_dim) + 3 * hidden * intermediate  # q, o, k, v; gate, up, down
    per_token = 2.0 * (layers * per_layer + hidden * int(model_config.vocab_size))
    return per_token, 4.0 * layers * hidden


def plan_cost(widths: list[list[int]], per_token: float, per_pair: float) -> float:
    """Estimated forward FLOPs of micro-batches given as the widths of their bins (rows): every bin
    of a micro-batch is as wide as its widest."""
    return sum(len(w) * (per_token * max(w) + per_pair * max(w) ** 2) for w in widths if w)


def shared_prompt_width(
    rows: list[int], prompt_keys: list[bytes], prompt_lengths: list[int], lengths: list[int]
) -> int:
    """Tokens of a bin with shared prompts: each family's prompt once, then every row's response."""
    prompts = {prompt_keys[i]: prompt_lengths[i] for i in rows}
    return sum(prompts.values()) + sum(lengths[i] - prompt_lengths[i] for i in rows)


def prompt_keys_and_lengths(tensors: dict[str, torch.Tensor]) -> tuple[list[bytes], list[int]]:
    """Each row's prompt (its real tokens, as bytes: a dict key) and the prompt's length."""
    input_ids, attention = tensors["input_ids"], tensors["attention_mask"]
    prompt_width = input_ids.shape[1] - tensors["responses"].shape[1]
    real = attention[:, :prompt_width].bool()
    lengths = real.sum(-1).tolist()
    prompts = input_ids[:, :prompt_width].cpu()
    keys = [prompts[i, prompt_width - n :].numpy().tobytes() for i, n in enumerate(lengths)]
    return keys, lengths


@dataclass
class PackedSequences:
    """Rows of packed sequences and where each response token's logit sits in them."""

    input_ids: torch.Tensor  # [bins, width]
    position_ids: torch.Tensor  # [bins, width], restarting at every sequence
    bin_row: torch.Tensor  # [N] for every real response token: its packed row ...
    bin_col: torch.Tensor  # [N] ... and the column of the logit that predicts it
    seq: torch.Tensor  # [N] its row in the padded batch ...
    pos: torch.Tensor  # [N] ... and its response position
    allowed: torch.Tensor | None = None  # [bins, width, width] who attends to whom (shared prompts)


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


def pack_shared_prompts(
    micro: dict[str, torch.Tensor], bins: list[list[int]], pad_token_id: int = 0
) -> PackedSequences:
    """Pack a padded micro-batch into ``bins`` of rows: within a bin the rows sharing a prompt (a
    family) are laid out as that prompt once, then each row's response; ``allowed`` lets a prompt
    token see its family's prompt causally and a response token its family's prompt and its own
    response causally. Index lists are built in Python, the tensors in one gather each."""
    input_ids, attention, positions = micro["input_ids"], micro["attention_mask"], micro["position_ids"]
    prompt_width = input_ids.shape[1] - micro["responses"].shape[1]
    keys, prompt_lengths = prompt_keys_and_lengths(micro)
    response_lengths = attention[:, prompt_width:].sum(-1).tolist()
    lay = _SharedPromptLayout(keys, prompt_lengths, response_lengths, prompt_width)
    for k, members in enumerate(bins):
        lay.add_bin(k, members)
    width = max(max((len(rows) for rows, _, _ in lay.bins), default=1), 1)
    n = len(bins)
    src_row = torch.zeros((n, width), dtype=torch.long)
    src_col = torch.zeros((n, width), dtype=torch.long)
    seg = torch.full((n, width), -1, dtype=torch.long)  # -1: padding
    for k, (rows, cols, segs) in enumerate(lay.bins):
        src_row[k, : len(rows)] = torch.tensor(rows, dtype=torch.long)
        src_col[k, : len(cols)] = torch.tensor(cols, dtype=torch.long)
        seg[k, : len(segs)] = torch.tensor(segs, dtype=torch.long)
    real = seg >= 0
    packed_ids = torch.where(real, input_ids[src_row, src_col], torch.full_like(src_row, pad_token_id))
    tail = torch.arange(width).expand(n, width) - real.sum(-1, keepdim=True)  # padding: positions restart
    packed_pos = torch.where(real, positions[src_row, src_col], tail.clamp(min=0).to(positions.dtype))
    return PackedSequences(
        packed_ids,
        packed_pos,
        torch.tensor(lay.bin_row, dtype=torch.long),
        torch.tensor(lay.bin_col, dtype=torch.long),
        torch.tensor(lay.seq, dtype=torch.long),
        torch.tensor(lay.pos, dtype=torch.long),
        _shared_prompt_mask(seg, real, lay.family_of),
    )


class _SharedPromptLayout:
    """Where every token of a shared-prompt packing comes from, built bin by bin: per bin its
    source rows, source columns and segments; per response token its place in the packed logits
    (``bin_row``, ``bin_col``) and in the response (``seq``, ``pos``)."""

    def __init__(
        self, keys: list[bytes], prompt_lengths: list[int], response_lengths: list[int], prompt_width: int
    ) -> None:
        self.keys = keys
        self.prompt_lengths = prompt_lengths
        self.response_lengths = response_lengths
        self.prompt_width = prompt_width
        self.bins: list[tuple[list[int], list[int], list[int]]] = []  # per bin: source row, column, segment
        self.bin_row: list[int] = []
        self.bin_col: list[int] = []
        self.seq: list[int] = []
        self.pos: list[int] = []
        self.segment = 0  # numbers every family's prompt and every response apart, across the micro-batch
        self.family_of: list[int] = []  # segment -> the segment of its family's prompt

    def add_bin(self, k: int, members: list[int]) -> None:
        families: dict[bytes, list[int]] = {}
        for b in members:
            families.setdefault(self.keys[b], []).append(b)
        rows: list[int] = []
        cols: list[int] = []
        segs: list[int] = []
        for family_rows in families.values():
            first = family_rows[0]
            p = self.prompt_lengths[first]
            prompt_segment = self.segment
            self.family_of.append(prompt_segment)
            self.segment += 1
            last_prompt_column = len(rows) + p - 1
            rows += [first] * p
            cols += range(self.prompt_width - p, self.prompt_width)
            segs += [prompt_segment] * p
            for b in family_rows:
                self._add_response(k, b, p, prompt_segment, last_prompt_column, rows, cols, segs)
        self.bins.append((rows, cols, segs))

    def _add_response(
        self,
        k: int,
        b: int,
        p: int,
        prompt_segment: int,
        last_prompt_column: int,
        rows: list[int],
        cols: list[int],
        segs: list[int],
    ) -> None:
        """Row ``b``'s response after its family's prompt (``p`` tokens) in bin ``k``."""
        r = self.response_lengths[b]
        if r and not p:
            raise ValueError(
                f"row {b} of the micro-batch has a response but no prompt token to predict it from"
            )
        start = len(rows)
        rows += [b] * r
        cols += range(self.prompt_width, self.prompt_width + r)
        segs += [self.segment] * r
        self.family_of.append(prompt_segment)
        self.segment += 1
        # response token 0 is predicted by the prompt's last token, token j by response token j - 1
        if r:
            self.bin_row += [k] * r
            self.bin_col += [last_prompt_column, *range(start, start + r - 1)]
            self.seq += [b] * r
            self.pos += range(r)


def _shared_prompt_mask(seg: torch.Tensor, real: torch.Tensor, family_of: list[int]) -> torch.Tensor:
    """Who sees whom in a shared-prompt packing: a token its family's prompt and its own segment,
    causally; padding itself only."""
    width = seg.shape[1]
    # every token's family (the segment of its family's prompt); padding -1
    family = torch.tensor(family_of + [-1], dtype=torch.long)[seg]
    is_prompt = real & (seg == family)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same_family = (family[:, :, None] == family[:, None, :]) & real[:, :, None] & real[:, None, :]
    sees = (seg[:, :, None] == seg[:, None, :]) | is_prompt[:, None, :]  # its own segment, or the prompt
    allowed = same_family & sees & causal
    allowed |= torch.eye(width, dtype=torch.bool) & ~real[:, :, None]  # padding sees itself only
    return allowed


def hf_config(model: Any) -> Any:
    """The HF config of a model, or of the model a DeepSpeed engine wraps (the engine's own
    ``config`` is DeepSpeed's)."""
    from transformers import PretrainedConfig

    for holder in (model, getattr(model, "module", None)):
        config = getattr(holder, "config", None)
        if isinstance(config, PretrainedConfig):
            return config
    return None


def attention_kind(model: Any) -> str:
    return getattr(hf_config(model), "_attn_implementation", None) or "eager"


def _attention_mask_for(model: Any, allowed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``allowed`` as the 4-D mask the model's attention takes as given: boolean for SDPA, additive
    (0 / the dtype's minimum) for eager, which adds it to the scores."""
    kind = attention_kind(model)
    if kind == "flash_attention_2":
        raise ValueError(
            "service.train_service.actor.share_prompt needs eager or sdpa attention, not "
            "model.attn_implementation=flash_attention_2 (it takes no custom mask)"
        )
    mask = allowed[:, None].to(device)
    if kind == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill(
        ~mask, torch.finfo(torch.float32).min
    )


def packed_response_log_probs_and_entropy(
    model: Any,
    micro: dict[str, torch.Tensor],
    with_entropy: bool,
    entropy_grad: bool,
    bins: list[list[int]] | None = None,
    share_prompt: bool = False,
    chunk_tokens: int = 0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(response token | prefix) and (``with_entropy``) the policy's entropy at every response
    position, both [rows, response_len] in fp32 and 0 past each response, from one packed forward
    (``share_prompt``: ``bins`` are families of rows with one prompt, computed once);
    ``chunk_tokens`` > 0: the LM head scores that many positions at a time (``trainer.logprobs``);
    pi is the softmax of logits / ``temperature``, the policy the rollouts sampled."""
    device = micro["input_ids"].device
    if share_prompt:
        assert bins is not None, "shared prompts are packed by the plan's families"
        packed = pack_shared_prompts(micro, bins)
        assert packed.allowed is not None
        attention_mask = _attention_mask_for(model, packed.allowed, device)
    else:
        packed = pack_sequences(micro, bins)
        attention_mask = None  # the position ids carry the sequence boundaries
    kwargs = {
        "input_ids": packed.input_ids.to(device),
        "attention_mask": attention_mask,
        "position_ids": packed.position_ids.to(device),
        "use_cache": False,
    }
    seq, pos = packed.seq.to(device), packed.pos.to(device)
    shape = micro["responses"].shape
    tokens = micro["responses"][seq, pos]
    bin_row, bin_col = packed.bin_row.to(device), packed.bin_col.to(device)
    if chunk_tokens:
        return _chunked_packed_scores(
            model,
            kwargs,
            (bin_row, bin_col, seq, pos, tokens),
            shape,
            chunk_tokens,
            with_entropy,
            entropy_grad,
            temperature,
        )
    logits = model(**kwargs).logits[bin_row, bin_col].float()  # [N, V]
    log_p = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    logp = torch.zeros(shape, dtype=torch.float32, device=device).index_put(
        (seq, pos), log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    )
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        token_entropy = -(log_p.exp() * log_p).sum(-1)
        entropy = torch.zeros(shape, dtype=torch.float32, device=device).index_put((seq, pos), token_entropy)
    return logp, entropy


def _chunked_packed_scores(
    model: Any,
    forward_kwargs: dict[str, Any],
    where: tuple[torch.Tensor, ...],
    shape: torch.Size,
    chunk_tokens: int,
    with_entropy: bool,
    entropy_grad: bool,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The packed forward's log-probs (and entropy) with the LM head in bounded memory, scattered
    back to ``shape``; ``where``: each response token's (packed row, column, row, position, token)."""
    bin_row, bin_col, seq, pos, tokens = where

    def select(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden[bin_row, bin_col], tokens

    logp, entropy = scores_through_head(
        model, forward_kwargs, select, chunk_tokens, with_entropy, entropy_grad, temperature
    )
    device = tokens.device
    logp_full = torch.zeros(shape, dtype=torch.float32, device=device).index_put((seq, pos), logp)
    if entropy is None:
        return logp_full, None
    return logp_full, torch.zeros(shape, dtype=torch.float32, device=device).index_put((seq, pos), entropy)
