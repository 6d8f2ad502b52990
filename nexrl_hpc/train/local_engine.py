"""The ``local`` train backend: one process, one model, the whole PPO/GRPO update.

Token-level PPO-clip loss, optional KL to a frozen reference, mini-batches (one optimizer step
each) split into micro-batches whose gradients accumulate with a mini-batch-wide normaliser,
grad-norm clipping, AdamW, linear LR warm-up then constant or cosine. A non-finite loss or
gradient skips that optimizer step and is reported in the metrics (``actor/nan_skipped``).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import warnings
from typing import Any

import torch

from nexrl_hpc.algorithm.core_algos import aggregate, kl_penalty, ppo_clip_loss
from nexrl_hpc.checkpoint.hf import fsync_path, read_safetensors_dir, write_hf_model_dir
from nexrl_hpc.models.tiny import load_model
from nexrl_hpc.train.service import TrainServiceClient

logger = logging.getLogger(__name__)

REQUIRED_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def check_training_batch(tensors: dict[str, Any], need: tuple[str, ...]) -> int:
    """Validate names and row counts before any work; returns the batch size."""
    missing = [k for k in need if k not in tensors]
    if missing:
        raise KeyError(f"training batch is missing {missing}")
    sizes = {k: int(v.shape[0]) for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"training batch tensors have different row counts: {sizes}")
    r = tensors["responses"].shape[1]
    for k in ("response_mask", "old_log_probs", "advantages"):
        if k in tensors and tensors[k].shape[1] != r:
            raise ValueError(f"training batch {k!r} has {tensors[k].shape[1]} columns, responses has {r}")
    return next(iter(sizes.values()))


def response_log_probs(model: Any, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """log pi(response token | prefix) for every response position, [B, R], in fp32."""
    responses = micro["responses"]
    r = responses.shape[1]
    out = model(
        input_ids=micro["input_ids"],
        attention_mask=micro["attention_mask"],
        position_ids=micro["position_ids"],
        use_cache=False,
        logits_to_keep=r + 1,
    )
    logits = out.logits[:, :-1, :].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def lr_factor(step: int, warmup: int, schedule: str, total: int, min_ratio: float) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        span = max(total - warmup, 1)
        progress = min(max(step - warmup, 0) / span, 1.0)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


class LocalTrainEngine(TrainServiceClient):
    def __init__(self, base_model_dir: str):
        self._base_model_dir = base_model_dir
        self._cfg: dict[str, Any] | None = None
        self.model: Any = None
        self.ref_model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.device = torch.device("cpu")

    # --- lifecycle ------------------------------------------------------------------------------
    def initialize_worker(
        self, config_dict: dict[str, Any], role: str = "actor", world_size: int = 1
    ) -> None:
        if world_size != 1:
            raise ValueError(f"backend=local runs one process; got world_size={world_size}")
        self._cfg = config_dict
        torch.set_num_threads(config_dict["num_threads"])

    def init_model(self) -> None:
        cfg = self._require_cfg()
        if cfg["device"] == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("service.train_service.device=cuda but no CUDA device is visible")
        self.device = torch.device(cfg["device"])
        dtype = getattr(torch, cfg["dtype"])
        self.model = load_model(
            self._base_model_dir,
            dtype=dtype,
            device=self.device,
            attn_implementation=cfg["attn_implementation"],
        )
        self.model.train()
        if cfg["algorithm"]["kl_loss_coef"] > 0:
            self.ref_model = copy.deepcopy(self.model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        optim = cfg["actor"]["optim"]
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=optim["lr"],
            betas=tuple(optim["betas"]),
            eps=optim["eps"],
            weight_decay=optim["weight_decay"],
        )
        warmup, schedule = optim["lr_warmup_steps"], optim["lr_scheduler"]
        total, min_ratio = cfg["total_training_steps"], optim["min_lr_ratio"]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup, schedule, total, min_ratio)
        )

    def _require_cfg(self) -> dict[str, Any]:
        if self._cfg is None:
            raise RuntimeError("initialize_worker must be called before init_model")
        return self._cfg

    # --- compute --------------------------------------------------------------------------------
    def _to_device(self, tensors: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}

    @torch.no_grad()
    def compute_log_prob(self, batch: dict[str, Any]) -> dict[str, Any]:
        tensors = batch["batch"]
        n = check_training_batch(tensors, REQUIRED_KEYS)
        micro = self._require_cfg()["actor"]["ppo_micro_batch_size"]
        was_training = self.model.training
        self.model.eval()
        chunks = []
        for start in range(0, n, micro):
            part = self._to_device(
                {k: v[start : start + micro] for k, v in tensors.items() if isinstance(v, torch.Tensor)}
            )
            chunks.append(response_log_probs(self.model, part).cpu())
        self.model.train(was_training)
        return {"batch": {"old_log_probs": torch.cat(chunks, dim=0)}, "meta_info": {}}

    def update_actor(self, batch: dict[str, Any]) -> dict[str, Any]:
        cfg = self._require_cfg()
        actor = cfg["actor"]
        algo = cfg["algorithm"]
        tensors = batch["batch"]
        n = check_training_batch(tensors, REQUIRED_KEYS + ("old_log_probs", "advantages"))
        behaviour = tensors.get("behaviour_log_probs")
        mini, micro = min(actor["ppo_mini_batch_size"], n), actor["ppo_micro_batch_size"]
        agg = actor["loss_agg_mode"]
        assert self.optimizer is not None and self.scheduler is not None
        sums = {"pg_loss": 0.0, "kl_loss": 0.0, "clipfrac": 0.0, "ppo_kl": 0.0, "tokens": 0.0}
        grad_norms: list[float] = []
        nan_skipped = 0
        mismatch_max = 0.0
        steps_done = 0
        for _ in range(actor["ppo_epochs"]):
            for m_start in range(0, n, mini):
                m_end = min(m_start + mini, n)
                mask_all = tensors["response_mask"][m_start:m_end]
                normalizer = (
                    float(mask_all.sum().clamp(min=1.0)) if agg == "token-mean" else float(m_end - m_start)
                )
                self.optimizer.zero_grad(set_to_none=True)
                finite = True
                for start in range(m_start, m_end, micro):
                    end = min(start + micro, m_end)
                    part = self._to_device(
                        {k: v[start:end] for k, v in tensors.items() if isinstance(v, torch.Tensor)}
                    )
                    logp = response_log_probs(self.model, part)
                    mask = part["response_mask"]
                    if behaviour is not None and steps_done == 0:
                        diff = (logp.detach() - part["behaviour_log_probs"]).abs() * mask
                        mismatch_max = max(mismatch_max, float(diff.max()) if diff.numel() else 0.0)
                    loss, stats = ppo_clip_loss(
                        logp,
                        part["old_log_probs"],
                        part["advantages"],
                        mask,
                        actor["clip_ratio_low"],
                        actor["clip_ratio_high"],
                        agg,
                        normalizer,
                    )
                    sums["pg_loss"] += float(loss.detach())
                    if self.ref_model is not None:
                        with torch.no_grad():
                            ref_logp = response_log_probs(self.ref_model, part)
                        kl = aggregate(
                            kl_penalty(logp, ref_logp, algo["kl_loss_type"]), mask, agg, normalizer
                        )
                        loss = loss + algo["kl_loss_coef"] * kl
                        sums["kl_loss"] += float(kl.detach())
                    if not torch.isfinite(loss):
                        finite = False
                        break
                    loss.backward()
                    sums["clipfrac"] += float(stats["clipfrac_sum"])
                    sums["ppo_kl"] += float(stats["ppo_kl_sum"])
                    sums["tokens"] += float(stats["tokens"])
                grad_norm = (
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), actor["grad_clip"])
                    if finite
                    else torch.tensor(float("nan"))
                )
                if not finite or not torch.isfinite(grad_norm):
                    self.optimizer.zero_grad(set_to_none=True)
                    nan_skipped += 1
                    logger.warning("non-finite loss or gradient: optimizer step skipped")
                else:
                    self.optimizer.step()
                grad_norms.append(float(grad_norm))
                steps_done += 1
        lr = self.scheduler.get_last_lr()[0]
        with (
            warnings.catch_warnings()
        ):  # a step whose optimizer steps were all skipped still advances the schedule
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        tokens = max(sums["tokens"], 1.0)
        metrics = {
            "actor/pg_loss": sums["pg_loss"] / steps_done,
            "actor/kl_loss": sums["kl_loss"] / steps_done,
            "actor/loss": (sums["pg_loss"] + algo["kl_loss_coef"] * sums["kl_loss"]) / steps_done,
            "actor/pg_clipfrac": sums["clipfrac"] / tokens,
            "actor/ppo_kl": sums["ppo_kl"] / tokens,
            "actor/grad_norm": sum(grad_norms) / len(grad_norms),
            "actor/lr": lr,
            "actor/nan_skipped": nan_skipped,
            "actor/optimizer_steps": steps_done - nan_skipped,
        }
        if behaviour is not None:
            metrics["actor/logprob_mismatch_max"] = mismatch_max
        return {"meta_info": {"metrics": metrics}}

    # --- weights and checkpoints ----------------------------------------------------------------
    def _state_dict(self) -> dict[str, torch.Tensor]:
        return {
            k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype)
            for k, v in self.model.state_dict().items()
        }

    def export_weights(self, path: str) -> None:
        cfg = self._require_cfg()
        write_hf_model_dir(
            self._state_dict(), self._base_model_dir, path, cfg["export_max_shard_mb"] << 20, fsync=False
        )

    def save_checkpoint(self, local_path: str, global_step: int, save_weight_only: bool = False) -> None:
        cfg = self._require_cfg()
        write_hf_model_dir(
            self._state_dict(),
            self._base_model_dir,
            os.path.join(local_path, "model"),
            cfg["export_max_shard_mb"] << 20,
            fsync=True,
        )
        if save_weight_only:
            return
        assert self.optimizer is not None and self.scheduler is not None
        opt_dir = os.path.join(local_path, "optimizer")
        os.makedirs(opt_dir, exist_ok=True)
        path = os.path.join(opt_dir, "rank_0.pt")
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "global_step": global_step,
                "world_size": 1,
            },
            path,
        )
        fsync_path(path)
        fsync_path(opt_dir)

    def load_checkpoint(self, local_path: str, load_optimizer: bool = True) -> None:
        model_dir = os.path.join(local_path, "model")
        state = read_safetensors_dir(model_dir)
        missing, unexpected = self.model.load_state_dict(
            {k: v.to(self.device) for k, v in state.items()}, strict=False
        )
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise ValueError(
                f"{model_dir}: missing {sorted(set(missing) - tied)[:5]}, unexpected {unexpected[:5]}"
            )
        if not load_optimizer:
            return
        opt_path = os.path.join(local_path, "optimizer", "rank_0.pt")
        if not os.path.exists(opt_path):
            raise FileNotFoundError(
                f"{opt_path}: optimizer state missing (checkpoint saved with save_weight_only?)"
            )
        saved = torch.load(opt_path, map_location="cpu", weights_only=True)
        if saved.get("world_size", 1) != 1:
            raise ValueError(f"{opt_path} was written by {saved['world_size']} ranks; backend=local needs 1")
        assert self.optimizer is not None and self.scheduler is not None
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
