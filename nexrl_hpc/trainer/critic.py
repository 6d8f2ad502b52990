"""The critic of PPO: a value model (an HF model directory with a one-output token head) trained
by a ``PolicyTrainer`` of its own kind, so it runs where any trainer runs — in this process, or on
trainer ranks of its own (single, FSDP2 or DeepSpeed ZeRO; the MPI job's ``critic`` group) — with
its own AdamW, LR schedule and checkpoint files.

The value model is ``AutoModelForTokenClassification`` with one label (verl's critic): the base
model's weights from ``service.train_service.critic.model_path`` (null: the policy's initial model,
a separate copy) and a fresh linear ``score`` head, without classifier dropout. V at response
position t is the head's output at the position before token t (the state the token was generated
from), padded as the actor's batch is; only ``response_mask`` tokens count.

It speaks the trainer's two batch operations: ``compute_log_prob`` answers the values (in
``old_log_probs``), ``update_actor`` trains on the clipped value loss with the batch's
``old_log_probs`` as the values GAE used and ``advantages`` as the returns (``critic_batch``).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from nexrl_hpc.algorithm.gae import value_loss
from nexrl_hpc.trainer.policy_trainer import MicroBatch, PolicyTrainer

logger = logging.getLogger(__name__)

VALUE_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def load_value_model(model_dir: str, device: torch.device, dtype: torch.dtype = torch.float32) -> Any:
    """The base model of ``model_dir`` under a one-output token head, without the classifier's
    dropout (transformers' default 0.1 would make every value a random draw; verl sets it to 0 too)."""
    config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    config.classifier_dropout = 0.0
    model = AutoModelForTokenClassification.from_pretrained(model_dir, config=config, dtype=dtype)
    return model.to(device)


def response_values(model: Any, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """V(state before response token t) for every response position, [B, R], fp32."""
    r = micro["responses"].shape[1]
    out = model(
        input_ids=micro["input_ids"],
        attention_mask=micro["attention_mask"],
        position_ids=micro["position_ids"],
        use_cache=False,
    )
    return out.logits[:, -r - 1 : -1, 0].float()


def critic_batch(
    tensors: dict[str, torch.Tensor], values: torch.Tensor, returns: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The critic's update batch in the trainer's contract: the sequences, the values GAE used
    (``old_log_probs``) and the returns (``advantages``)."""
    return {**{k: tensors[k] for k in VALUE_INPUTS}, "old_log_probs": values, "advantages": returns}


def critic_service_config(train_config: dict[str, Any], critic: dict[str, Any]) -> dict[str, Any]:
    """The critic's ``initialize_worker`` payload: the trainer's settings with the critic's
    update settings as its ``actor`` section, its own engine, padded rows, no KL reference."""
    actor = train_config["actor"]
    return {
        **train_config,
        "engine": critic["engine"],
        "value_head": None,  # the value model's own head (AutoModelForTokenClassification)
        "sequence_parallel_size": 1,
        "algorithm": dict(train_config["algorithm"], kl_loss_coef=0.0),
        "actor": {
            **{k: critic[k] for k in ("ppo_epochs", "ppo_mini_batch_size", "ppo_micro_batch_size")},
            **{k: critic[k] for k in ("cliprange_value", "loss_agg_mode", "grad_clip", "optim")},
            "ppo_max_token_len_per_gpu": None,
            "packing": False,
            "share_prompt": False,
            "loss_norm_tokens": actor["loss_norm_tokens"],
        },
    }


class ValueTrainer(PolicyTrainer):
    """The critic's trainer on one rank: the value model instead of the policy, the value loss
    instead of the policy loss; the batch plan, the parallel engines and the checkpoint files are
    the policy trainer's."""

    def _load_model(self, model_dir: str, dtype: torch.dtype) -> Any:
        return load_value_model(model_dir, self.device, dtype)

    def _log_probs(
        self, micro: MicroBatch, with_entropy: bool, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The micro-batch's values (``compute_log_prob`` answers them)."""
        with self._compute():
            values = response_values(self.model, micro.tensors)
        return values, (torch.zeros_like(values) if with_entropy else None)

    def update_actor_shard(self, shard: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
        """``ppo_epochs`` passes over the planned mini-batches, one AdamW step each on the clipped
        value loss; the metrics are global (reduced over the critic's ranks)."""
        cfg = self._require_cfg()
        par = self._require_parallel()
        critic = cfg["actor"]
        assert self.optimizer is not None and self.scheduler is not None
        sums = [0.0, 0.0, 0.0, 0.0]  # loss, clipped tokens, predicted values, tokens (this rank's)
        grad_norms: list[float] = []
        skipped = 0
        for _ in range(critic["ppo_epochs"]):
            lo = 0
            for counts, normalizer, passes, ranges in zip(
                plan["counts"], plan["normalizers"], plan["passes"], plan["micro"]
            ):
                par.zero_grad(self.model, self.optimizer)
                for i in range(passes):
                    micro = self._micro(shard, lo, ranges[par.rank], i, plan["shared_prompts"])
                    part = micro.tensors
                    with self._compute():
                        predicted = response_values(self.model, part)
                    loss, stats = value_loss(
                        predicted,
                        part["old_log_probs"],
                        part["advantages"],
                        part["response_mask"],
                        critic["cliprange_value"],
                        critic["loss_agg_mode"],
                        normalizer,
                    )
                    weight = par.loss_scale() if micro.real else 0.0  # a stand-in pass adds nothing
                    par.backward(self.model, loss * weight, last_in_step=i == passes - 1)
                    if micro.real:
                        values = (
                            loss.detach(),
                            stats["vf_clipfrac_sum"],
                            stats["vpred_sum"],
                            stats["tokens"],
                        )
                        sums = [a + float(b) for a, b in zip(sums, values)]
                norm, stepped = par.step(self.model, self.optimizer, critic["grad_clip"])
                grad_norms.append(norm)
                skipped += int(not stepped)
                lo += counts[par.rank]
        lr = self.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():  # a step whose optimizer steps were all skipped
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        loss_sum, clipped, vpred, tokens = par.all_reduce_sum(sums)
        tokens = max(tokens, 1.0)
        return {
            "critic/vf_loss": loss_sum / max(len(grad_norms), 1),
            "critic/vf_clipfrac": clipped / tokens,
            "critic/vpred_mean": vpred / tokens,
            "critic/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "critic/lr": float(lr),
            "critic/nan_skipped": skipped,
        }
