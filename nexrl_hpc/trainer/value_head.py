"""PPO's value head on the policy (``critic.head_on_policy``) in the trainer: how a batch asks for
values or for a warm-up update, where V is read during the policy's forward, and the head's loss
terms beside the actor's (the head itself: ``models.value_head``).

The trainer's two batch operations carry it without a protocol of their own: ``compute_log_prob``
answers V instead of log-probs when the batch holds a ``VALUE_QUERY`` column, and ``update_actor``
trains the head when the batch holds ``values`` and ``returns`` (with ``VALUE_WARMUP``: the head
alone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from nexrl_hpc.algorithm.gae import value_loss
from nexrl_hpc.models.value_head import is_value_head_name
from nexrl_hpc.trainer.logprobs import output_head

if TYPE_CHECKING:
    from nexrl_hpc.trainer.parallel import ParallelStrategy

VALUE_QUERY = "value_query"  # a compute_log_prob batch holding this column asks for the value head's V
# an update_actor batch holding this column trains the value head alone (PPO's critic warm-up): the
# value loss, no policy loss, every gradient but the head's dropped before each step, the LR schedule
# not advanced
VALUE_WARMUP = "value_warmup"
NO_VALUE_HEAD = "this trainer has no value head (service.train_service.critic.head_on_policy=false)"
ZERO3_HEAD_WARMUP = (
    "service.train_service.critic.warmup_steps > 0 with head_on_policy=true is not supported with "
    "engine=deepspeed (ZeRO-3 holds the gradients in its partitions: the trunk's cannot be left out): "
    "set critic.warmup_steps=0, or use engine=fsdp, or a value model of its own (head_on_policy=false)"
)


@contextlib.contextmanager
def captured_values(model: Any, value_head: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Each forward of ``model`` in the block appends V at its response positions, ``[B, R]`` fp32:
    the value head over the hidden states the LM head receives (the padded layout's last R + 1
    positions; V of response token t at the position before it, where its log-prob is read). It
    runs inside the model's forward, where a sharded engine has the head's weights gathered."""
    values: list[torch.Tensor] = []

    def value_of_head_input(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        values.append(value_head(args[0][:, :-1, :]).squeeze(-1).float())

    handle = output_head(model).register_forward_pre_hook(value_of_head_input)
    try:
        yield values
    finally:
        handle.remove()


def drop_all_but_the_value_heads_gradients(model: torch.nn.Module) -> None:
    """A warm-up update trains the value head alone: every other gradient is dropped before the step
    (AdamW skips a parameter without one). After the backward, not by detaching the trunk: FSDP2
    then reduces the head's gradient as in any update."""
    for name, p in model.named_parameters():
        if not is_value_head_name(name):
            p.grad = None


class ValueHeadLoss:
    """``vf_coef`` x the clipped value loss of one micro-batch (aggregated as the actor's loss), and
    its terms over an update on this rank, reported as the separate critic's metrics."""

    def __init__(self, settings: dict[str, Any], loss_agg_mode: str):
        self.vf_coef = float(settings["vf_coef"])
        self.cliprange_value = settings["cliprange_value"]
        self.loss_agg_mode = loss_agg_mode
        self.sums = [0.0, 0.0, 0.0, 0.0]  # loss, clipped tokens, predicted values, tokens

    def __call__(
        self, predicted: torch.Tensor, part: dict[str, torch.Tensor], normalizer: float | None, real: bool
    ) -> torch.Tensor:
        loss, stats = value_loss(
            predicted,
            part["values"],
            part["returns"],
            part["response_mask"],
            self.cliprange_value,
            self.loss_agg_mode,
            normalizer,
        )
        if real:  # a stand-in pass adds nothing
            terms = (loss.detach(), stats["vf_clipfrac_sum"], stats["vpred_sum"], stats["tokens"])
            self.sums = [a + float(b) for a, b in zip(self.sums, terms)]
        return self.vf_coef * loss

    def metrics(self, par: ParallelStrategy, optimizer_steps: int) -> dict[str, float]:
        loss_sum, clipped, vpred, tokens = par.all_reduce_sum(self.sums)
        return {
            "critic/vf_loss": loss_sum / max(optimizer_steps, 1),
            "critic/vf_clipfrac": clipped / max(tokens, 1.0),
            "critic/vpred_mean": vpred / max(tokens, 1.0),
        }


def value_head_of_update(
    shard: dict[str, Any], settings: dict[str, Any] | None, actor: dict[str, Any], engine: str
) -> tuple[ValueHeadLoss | None, bool]:
    """An update batch's value head term (None: the batch has no ``returns``, nothing for a head)
    and whether the update is a warm-up (``VALUE_WARMUP``: the head alone)."""
    if "returns" not in shard:
        return None, False
    if settings is None:
        raise ValueError(NO_VALUE_HEAD)
    warmup = VALUE_WARMUP in shard
    if warmup and engine == "deepspeed":
        raise ValueError(ZERO3_HEAD_WARMUP)
    return ValueHeadLoss(settings, actor["loss_agg_mode"]), warmup
