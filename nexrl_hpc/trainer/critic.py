"""The critic of PPO: a value model (an HF model directory with a one-output token head), its own
AdamW and LR schedule, and the clipped value update, in the trainer's process.

The value model is ``AutoModelForTokenClassification`` with one label (verl's critic): the base
model's weights from ``service.train_service.critic.model_path`` (null: the policy's initial model,
a separate copy) and a fresh linear ``score`` head. V at response position t is the head's output
at the position before token t (the state the token was generated from), padded as the actor's
batch is; only ``response_mask`` tokens count. Checkpoints are the trainer's files
(``checkpoint.trainer_io``) under ``<checkpoint>/critic``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from nexrl_hpc.algorithm.gae import value_loss
from nexrl_hpc.checkpoint.trainer_io import TrainerCheckpointIO
from nexrl_hpc.trainer.parallel import SingleProcess
from nexrl_hpc.trainer.policy_trainer import lr_factor

logger = logging.getLogger(__name__)

VALUE_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def load_value_model(model_dir: str, device: torch.device) -> Any:
    """The base model of ``model_dir`` under a one-output token head (fp32 master weights), without
    the classifier's dropout (transformers' default 0.1 would make every value a random draw; verl
    sets it to 0 too)."""
    config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    config.classifier_dropout = 0.0
    model = AutoModelForTokenClassification.from_pretrained(model_dir, config=config, dtype=torch.float32)
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


class CriticTrainer:
    """The value model and its update (``service.train_service.critic``), on this process."""

    def __init__(self, critic_cfg: dict[str, Any], model_dir: str, train_cfg: dict[str, Any]):
        self.cfg = critic_cfg
        self.model_dir = model_dir
        self.device = torch.device(train_cfg["device"])
        self._export_max_shard_mb = train_cfg["export_max_shard_mb"]
        self._total_steps = train_cfg["total_training_steps"]
        self.parallel = SingleProcess()
        self.model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None

    def init_model(self) -> None:
        optim = self.cfg["optim"]
        self.model = load_value_model(self.model_dir, self.device)
        self.model.train()

        def make_optimizer(params: Any) -> torch.optim.Optimizer:
            return torch.optim.AdamW(
                params,
                lr=optim["lr"],
                betas=tuple(optim["betas"]),
                eps=optim["eps"],
                weight_decay=optim["weight_decay"],
            )

        self.model, self.optimizer = self.parallel.setup(self.model, make_optimizer)
        warmup, schedule, min_ratio = optim["lr_warmup_steps"], optim["lr_scheduler"], optim["min_lr_ratio"]
        total = self._total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup, schedule, total, min_ratio)
        )

    def _rows(self, tensors: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: tensors[k].index_select(0, index).to(self.device) for k in tensors}

    @torch.no_grad()
    def compute_values(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The critic's values of a batch's response tokens, [B, R] (0 off the response mask)."""
        self.model.eval()
        n, micro = tensors["responses"].shape[0], self.cfg["ppo_micro_batch_size"]
        parts = []
        for lo in range(0, n, micro):
            rows = self._rows({k: tensors[k] for k in VALUE_INPUTS}, torch.arange(lo, min(lo + micro, n)))
            parts.append((response_values(self.model, rows) * rows["response_mask"]).cpu())
        self.model.train()
        return torch.cat(parts) if parts else torch.zeros(tensors["responses"].shape)

    def update_critic(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        """``ppo_epochs`` passes of mini-batches over the batch, each one AdamW step on the clipped
        value loss (micro-batches accumulate with the mini-batch's normaliser)."""
        assert self.optimizer is not None and self.scheduler is not None
        cfg = self.cfg
        n = tensors["responses"].shape[0]
        mini, micro = min(cfg["ppo_mini_batch_size"], n), cfg["ppo_micro_batch_size"]
        sums = {"loss": 0.0, "vf_clipfrac_sum": 0.0, "vpred_sum": 0.0, "tokens": 0.0}
        grad_norms: list[float] = []
        skipped = 0
        for _ in range(cfg["ppo_epochs"]):
            for m_lo in range(0, n, mini):
                m_hi = min(m_lo + mini, n)
                mask = tensors["response_mask"][m_lo:m_hi]
                normalizer = _normalizer(mask, cfg["loss_agg_mode"])
                self.parallel.zero_grad(self.model, self.optimizer)
                for lo in range(m_lo, m_hi, micro):
                    part = self._rows(tensors, torch.arange(lo, min(lo + micro, m_hi)))
                    loss, stats = value_loss(
                        response_values(self.model, part),
                        part["values"],
                        part["returns"],
                        part["response_mask"],
                        cfg["cliprange_value"],
                        cfg["loss_agg_mode"],
                        normalizer,
                    )
                    self.parallel.backward(self.model, loss, last_in_step=lo + micro >= m_hi)
                    sums["loss"] += float(loss.detach())
                    for key, value in stats.items():
                        sums[key] += float(value)
                norm, stepped = self.parallel.step(self.model, self.optimizer, cfg["grad_clip"])
                grad_norms.append(norm)
                skipped += int(not stepped)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        tokens = max(sums["tokens"], 1.0)
        return {
            "critic/vf_loss": sums["loss"] / max(len(grad_norms), 1),
            "critic/vf_clipfrac": sums["vf_clipfrac_sum"] / tokens,
            "critic/vpred_mean": sums["vpred_sum"] / tokens,
            "critic/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "critic/lr": float(lr),
            "critic/nan_skipped": skipped,
        }

    def _checkpoint_io(self) -> TrainerCheckpointIO:
        return TrainerCheckpointIO(
            self.parallel,
            self.model,
            self.optimizer,
            self.scheduler,
            engine="single",
            base_model_dir=self.model_dir,
            max_shard_bytes=self._export_max_shard_mb << 20,
        )

    def save_checkpoint(self, local_path: str, global_step: int) -> None:
        """The value model and the critic's optimizer under ``local_path`` (a checkpoint's ``critic/``)."""
        self._checkpoint_io().save(local_path, global_step)

    def load_checkpoint(self, local_path: str) -> None:
        if not os.path.isdir(local_path):
            raise FileNotFoundError(
                f"{local_path}: no critic in this checkpoint (saved by a run without "
                "algorithm.adv_estimator=gae?); a PPO run resumes only from a PPO run's checkpoint"
            )
        io = self._checkpoint_io()
        files = io.files(local_path)
        io.check(files, load_optimizer=True)
        io.load(files, load_optimizer=True)


def _normalizer(mask: torch.Tensor, agg_mode: str) -> float:
    """The mini-batch-wide normaliser of ``core_algos.aggregate`` (tokens, or sequences)."""
    if agg_mode == "token-mean":
        return float(mask.sum().clamp(min=1.0))
    return float(mask.shape[0]) * (mask.shape[1] if agg_mode == "seq-mean-token-sum-norm" else 1)
