"""Response log-probs and entropy in bounded memory: chunks of tokens through the LM head.

The materialised way (``log_softmax(logits.float())`` over the whole vocabulary, then ``exp`` of it
for the entropy) holds several ``[tokens, vocab]`` fp32 tensors at once: for one 32k-token response
of a 152k-vocabulary model that is ~20 GB per copy. Here the LM head is applied to
``chunk_tokens`` hidden states at a time; each chunk's logits live only while its log-prob of the
sampled token, its log-sum-exp and its entropy are taken (in fp32), and the backward pass
recomputes them chunk by chunk (``_ChunkedTokenScores``). What stays alive is ``[tokens, hidden]``
and a few ``[tokens]`` vectors; the largest transient is a few ``[chunk_tokens, vocab]`` tensors.

The head runs inside the LM head module's own forward (``scores_through_head`` swaps that module's
``forward`` for the call): the parallel engines gather its weight in hooks around that module
(FSDP2 at the root's forward, DeepSpeed ZeRO-3 at the head's own), and their backward hooks fire
on its output, so the weight is whole wherever it is read. The model's ``logits`` output then holds
``[positions, 2]`` — each selected position's log-prob and entropy — instead of logits.

Values and gradients are those of the materialised path (the same ``log_softmax`` per row; the
gradients its autograd graph would give), under autocast too: the head's matmul runs in the
compute dtype (as ``nn.Linear`` would), the softmax math in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

Select = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""From the hidden states the LM head receives, the rows to score ``[N, hidden]`` and their tokens ``[N]``."""


def _chunk_log_softmax(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """log pi over the vocabulary for a chunk of hidden states, [chunk, V] in fp32: the matmul as
    ``nn.Linear`` would run it (in the autocast dtype under autocast), then logits / temperature and
    the softmax in fp32."""
    logits = F.linear(hidden, weight, bias).float()
    return torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on, else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and weight.is_floating_point():
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _ChunkedTokenScores(torch.autograd.Function):
    """``[N, 2]`` fp32: log pi(token) and the entropy of pi at each of N positions, pi the softmax of
    logits / temperature, computed ``chunk`` rows at a time; backward recomputes each chunk's logits
    and applies d log pi(t)/dz = (onehot(t) - p) / T and dH/dz = -p (log p + H) / T to them."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        tokens: torch.Tensor,
        chunk: int,
        with_entropy: bool,
        entropy_grad: bool,
        temperature: float,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        scores = torch.zeros((n, 2), dtype=torch.float32, device=hidden.device)
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            log_p = _chunk_log_softmax(hidden[lo:hi], weight, bias, temperature)
            scores[lo:hi, 0] = log_p.gather(-1, tokens[lo:hi, None]).squeeze(-1)
            if with_entropy:
                scores[lo:hi, 1] = -(log_p.exp().mul_(log_p)).sum(-1)
            del log_p
        ctx.save_for_backward(hidden, weight, bias, tokens, scores)
        ctx.chunk, ctx.entropy_grad, ctx.temperature = chunk, entropy_grad and with_entropy, temperature
        ctx.compute_dtype = _compute_dtype(hidden, weight)  # backward runs outside autocast
        ctx.mark_non_differentiable(tokens)
        return scores

    @staticmethod
    def backward(ctx: Any, grad_scores: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, tokens, scores = ctx.saved_tensors
        dtype = ctx.compute_dtype
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        fp32 = {"dtype": torch.float32, "device": weight.device}
        grad_weight = torch.zeros(weight.shape, **fp32) if needs_weight else None
        grad_bias = torch.zeros(weight.shape[0], **fp32) if needs_bias else None
        weight_c = weight.to(dtype)
        bias_c = bias.to(dtype) if bias is not None else None
        n = hidden.shape[0]
        for lo in range(0, n, ctx.chunk):
            hi = min(lo + ctx.chunk, n)
            hidden_c = hidden[lo:hi].to(dtype)
            dz = _logit_grad(
                _chunk_log_softmax(hidden_c, weight_c, bias_c, ctx.temperature),
                tokens[lo:hi],
                grad_scores[lo:hi, 0],
                grad_scores[lo:hi, 1] if ctx.entropy_grad else None,
                scores[lo:hi, 1],
            )
            dz = (dz / ctx.temperature if ctx.temperature != 1.0 else dz).to(dtype)
            if grad_hidden is not None:
                grad_hidden[lo:hi] = (dz @ weight_c).to(hidden.dtype)
            if grad_weight is not None and dz.dtype == torch.float32:
                grad_weight.addmm_(dz.t(), hidden_c)
            elif grad_weight is not None:  # accumulated over chunks in fp32
                grad_weight += (dz.t() @ hidden_c).float()
            if grad_bias is not None:
                grad_bias += dz.float().sum(0)
            del dz
        grad_w = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_b = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_w, grad_b, None, None, None, None, None


def _logit_grad(
    log_p: torch.Tensor,
    tokens: torch.Tensor,
    grad_log_prob: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor,
) -> torch.Tensor:
    """d loss / d logits of a chunk, in place over ``log_p`` (fp32): g_lp (onehot - p) - g_H p (log p + H)."""
    p = log_p.exp()
    if grad_entropy is not None:
        factor = log_p.add_(entropy[:, None]).mul_(-grad_entropy[:, None]).sub_(grad_log_prob[:, None])
        dz = p.mul_(factor)
    else:
        dz = p.mul_(-grad_log_prob[:, None])
    del log_p
    rows = torch.arange(dz.shape[0], device=dz.device)
    dz[rows, tokens] += grad_log_prob
    return dz


def token_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tokens: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool,
    entropy_grad: bool,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(tokens) ``[N]`` and (``with_entropy``) the entropy ``[N]``, fp32, from hidden states
    ``[N, hidden]`` and an LM head's ``weight`` ``[V, hidden]`` (and ``bias``), ``chunk_tokens`` rows
    at a time; pi is the softmax of logits / ``temperature`` (the policy the rollouts sampled).
    The entropy carries gradient only with ``entropy_grad``."""
    if chunk_tokens < 1:
        raise ValueError(f"token_log_probs_and_entropy: chunk_tokens must be >= 1, got {chunk_tokens}")
    scores = _ChunkedTokenScores.apply(
        hidden, weight, bias, tokens, chunk_tokens, with_entropy, entropy_grad, temperature
    )
    return _split(scores, with_entropy, entropy_grad)


def _split(
    scores: torch.Tensor, with_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not with_entropy:
        return scores[..., 0], None
    entropy = scores[..., 1]
    return scores[..., 0], (entropy if entropy_grad and torch.is_grad_enabled() else entropy.detach())


def output_head(model: Any) -> torch.nn.Module:
    """The LM head module of an HF causal LM, or of the model a DeepSpeed engine wraps."""
    inner = getattr(model, "module", model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module) or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(
            f"service.train_service.logprob_chunk_tokens > 0 needs a model whose get_output_embeddings() "
            f"is a linear LM head; {type(inner).__name__} has {type(head).__name__} (set it to 0)"
        )
    if hasattr(head, "lora_A"):  # peft's LoRA layer: its weight is the base's, the adapter would be skipped
        raise ValueError(
            "service.train_service.logprob_chunk_tokens > 0 scores through the LM head's weight, which "
            "leaves out a LoRA adapter on the head (service.train_service.actor.lora.target_modules): set "
            "logprob_chunk_tokens=0, or train the head in full (lora.modules_to_save)"
        )
    return head


@contextmanager
def _head_forward(head: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """``head``'s forward replaced for the duration (its hooks, the engines' gathers, still run)."""
    saved = head.__dict__.get("forward")  # an instance attribute shadows the class's forward
    head.__dict__["forward"] = forward
    try:
        yield
    finally:
        if saved is None:
            del head.__dict__["forward"]
        else:
            head.__dict__["forward"] = saved


def scores_through_head(
    model: Any,
    forward_kwargs: dict[str, Any],
    select: Select,
    chunk_tokens: int,
    with_entropy: bool,
    entropy_grad: bool,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``model(**forward_kwargs)`` with its LM head scoring only the positions ``select`` picks,
    chunk by chunk: (log-probs ``[N]``, entropy ``[N]`` or None) of logits / ``temperature``, fp32."""
    head = output_head(model)

    def bounded_head(hidden: torch.Tensor) -> torch.Tensor:
        rows, tokens = select(hidden)
        return _ChunkedTokenScores.apply(
            rows, head.weight, head.bias, tokens, chunk_tokens, with_entropy, entropy_grad, temperature
        )

    if chunk_tokens < 1:
        raise ValueError(f"scores_through_head: chunk_tokens must be >= 1, got {chunk_tokens}")
    with _head_forward(head, bounded_head):
        scores = model(**forward_kwargs).logits
    return _split(scores, with_entropy, entropy_grad)


def padded_response_scores(
    model: Any,
    micro: dict[str, torch.Tensor],
    chunk_tokens: int,
    with_entropy: bool,
    entropy_grad: bool,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(response token | prefix) and the entropy, both ``[B, R]`` fp32, of a padded
    micro-batch, in bounded memory (``chunk_tokens`` positions at a time); pi at ``temperature``."""
    responses = micro["responses"]
    b, r = responses.shape

    def select(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the last r + 1 positions arrive; position j predicts response token j
        return hidden[:, :-1, :].reshape(b * r, hidden.shape[-1]), responses.reshape(b * r)

    kwargs = {
        "input_ids": micro["input_ids"],
        "attention_mask": micro["attention_mask"],
        "position_ids": micro["position_ids"],
        "use_cache": False,
        "logits_to_keep": r + 1,
    }
    logp, entropy = scores_through_head(
        model, kwargs, select, chunk_tokens, with_entropy, entropy_grad, temperature
    )
    return logp.reshape(b, r), (entropy.reshape(b, r) if entropy is not None else None)


def _response_log_softmax(model: Any, micro: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """log pi(. | prefix) over the vocabulary at every response position, [B, R, V], in fp32; pi is
    the softmax of logits / ``temperature`` (the rollouts' sampling temperature, as verl and TRL)."""
    r = micro["responses"].shape[1]
    out = model(
        input_ids=micro["input_ids"],
        attention_mask=micro["attention_mask"],
        position_ids=micro["position_ids"],
        use_cache=False,
        logits_to_keep=r + 1,
    )
    logits = out.logits[:, :-1, :].float()
    return torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)


def response_log_probs(
    model: Any, micro: dict[str, torch.Tensor], chunk_tokens: int = 0, temperature: float = 1.0
) -> torch.Tensor:
    """log pi(response token | prefix) for every response position, [B, R], in fp32;
    ``chunk_tokens`` > 0: that many positions at a time through the LM head (``trainer.logprobs``),
    0: the whole vocabulary materialised at once."""
    if chunk_tokens:
        return padded_response_scores(model, micro, chunk_tokens, False, False, temperature)[0]
    log_p = _response_log_softmax(model, micro, temperature)
    return log_p.gather(-1, micro["responses"].unsqueeze(-1)).squeeze(-1)


def response_log_probs_and_entropy(
    model: Any,
    micro: dict[str, torch.Tensor],
    entropy_grad: bool = False,
    chunk_tokens: int = 0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``response_log_probs`` and the policy's entropy at each response position, both [B, R].
    The entropy carries gradient only with ``entropy_grad`` (an entropy bonus trains on it;
    otherwise it is only logged and its graph would cost memory for nothing)."""
    if chunk_tokens:
        logp, chunked_entropy = padded_response_scores(
            model, micro, chunk_tokens, True, entropy_grad, temperature
        )
        assert chunked_entropy is not None
        return logp, chunked_entropy
    log_p = _response_log_softmax(model, micro, temperature)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = entropy_from_log_probs(log_p)
    return log_p.gather(-1, micro["responses"].unsqueeze(-1)).squeeze(-1), entropy


def entropy_from_log_probs(log_p: torch.Tensor) -> torch.Tensor:
    """-sum_v p log p over the last (vocabulary) axis."""
    return -(log_p.exp() * log_p).sum(-1)


def logit_temperature(cfg: dict[str, Any], part: dict[str, torch.Tensor]) -> float:
    """The temperature the logits are divided by: the batch's own ``logit_temperature`` column (the
    weight-sync canary asks for 1, as engines score prompts) or the rollouts' sampling temperature."""
    if "logit_temperature" in part:
        return float(part["logit_temperature"][0])
    return float(cfg["logit_temperature"])
