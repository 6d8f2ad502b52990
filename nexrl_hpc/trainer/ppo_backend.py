"""PPO with a learned critic (``algorithm.adv_estimator=gae``): the actor's backend with the critic
beside it, behind the one ``TrainBackend`` interface the train worker drives.

Each update: the critic's values of the batch -> GAE advantages and returns per token
(``algorithm.gae``, from the rewards the processor put on each response's last token) -> the
critic's clipped value update -> the actor's PPO update on those advantages. For the first
``critic.warmup_steps`` updates only the critic trains (verl's ``trainer.critic_warmup``): the
actor's weights are exported unchanged. Checkpoints hold the critic under ``<checkpoint>/critic``.

With ``critic.head_on_policy`` there is no critic backend: the values come from the value head on the
actor's own model (``compute_log_prob`` with a ``VALUE_QUERY`` column), and the actor's update trains
the head on the batch's ``values`` and ``returns`` in the same backward; a warm-up update
(``VALUE_WARMUP`` column) trains the head alone. The checkpoint is the actor's (the head's file
included) and the warm-up's progress.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from nexrl_hpc.algorithm.gae import gae_advantages
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.trainer.backend import TrainBackend, UpdateInFlight, _DoneUpdate
from nexrl_hpc.trainer.critic import VALUE_INPUTS, critic_batch, critic_service_config
from nexrl_hpc.trainer.value_head import VALUE_QUERY, VALUE_WARMUP

CRITIC_DIR = "critic"
UPDATES_FILE = "updates.json"  # the critic's update count (its warm-up's progress)
CRITIC_ONLY_KEYS = ("token_level_rewards",)  # what the actor's update does not take


class _WithCriticMetrics(UpdateInFlight):
    """The actor's update in flight, its answer carrying the critic's metrics too."""

    def __init__(self, update: UpdateInFlight, metrics: dict[str, Any]):
        self._update, self._metrics = update, metrics

    def done(self) -> bool:
        return self._update.done()

    def result(self) -> dict[str, Any]:
        answer = self._update.result()
        answer.setdefault("meta_info", {}).setdefault("metrics", {}).update(self._metrics)
        return answer


class PPOBackend(TrainBackend):
    """``actor`` and ``critic``: any backends (this process, a trainer group, a service); ``critic``
    None: the value head on the actor's model (``critic.head_on_policy``)."""

    def __init__(
        self,
        actor: TrainBackend,
        critic: TrainBackend | None,
        critic_cfg: dict[str, Any],
        gamma: float,
        lam: float,
    ):
        self.actor = actor
        self.critic = critic
        self.critic_cfg = critic_cfg
        self.gamma, self.lam = gamma, lam
        self.warmup_steps = critic_cfg["warmup_steps"]
        self.critic_updates = 0  # restored from the checkpoint (warm-up counts them)
        self.queues_updates = actor.queues_updates

    @classmethod
    def from_config(
        cls, config: RLTrainConfig, actor: TrainBackend, critic: TrainBackend | None
    ) -> PPOBackend:
        algo = config["algorithm"]
        critic_cfg = dict(config["service"]["train_service"]["critic"])
        return cls(actor, critic, critic_cfg, algo["gamma"], algo["lam"])

    # --- lifecycle: both ------------------------------------------------------------------------
    def initialize_worker(
        self, config_dict: dict[str, Any], role: str = "actor", world_size: int = 1
    ) -> None:
        self.actor.initialize_worker(config_dict, role, world_size)
        if self.critic is not None:
            critic_config = critic_service_config(config_dict, self.critic_cfg)
            world = self.critic_cfg["world_size"]
            self.critic.initialize_worker(critic_config, role="critic", world_size=world)

    def init_model(self) -> None:
        self.actor.init_model()
        if self.critic is not None:
            self.critic.init_model()

    # --- the update: critic first, then the actor on GAE's advantages ---------------------------
    def critic_step(self, tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        """Values, GAE, the critic's update: (the actor's batch with its advantages, the metrics)."""
        mask = tensors["response_mask"]
        inputs = {k: tensors[k] for k in VALUE_INPUTS}
        if self.critic is None:  # the actor's value head answers
            inputs[VALUE_QUERY] = torch.ones(mask.shape[0])
        answer = (self.critic or self.actor).compute_log_prob({"batch": inputs, "meta_info": {}})
        values = answer["batch"]["old_log_probs"].float() * mask
        advantages, returns = gae_advantages(
            tensors["token_level_rewards"], values, mask, self.gamma, self.lam
        )
        metrics: dict[str, Any] = {}
        if self.critic is not None:
            batch = critic_batch(tensors, values, returns)
            update = self.critic.update_actor({"batch": batch, "meta_info": {}})
            metrics.update(update["meta_info"]["metrics"])
        self.critic_updates += 1  # a value head's update: in the actor's, after this
        tokens = mask.sum().clamp(min=1.0)
        metrics["critic/values_mean"] = float((values * mask).sum() / tokens)
        metrics["critic/returns_mean"] = float((returns * mask).sum() / tokens)
        metrics["critic/advantages_abs_mean"] = float((advantages.abs() * mask).sum() / tokens)
        actor_batch = {k: v for k, v in tensors.items() if k not in CRITIC_ONLY_KEYS}
        actor_batch["advantages"] = advantages.to(torch.float32)
        if self.critic is None:  # the actor's update trains its value head on these
            actor_batch["values"], actor_batch["returns"] = values, returns.to(torch.float32)
        return actor_batch, metrics

    def _warming_up(self) -> bool:
        """The critic's updates so far are still warm-up (``critic.warmup_steps``)."""
        return self.critic_updates < self.warmup_steps

    def update_actor(self, batch: dict[str, Any]) -> dict[str, Any]:
        warming_up = self._warming_up()
        actor_batch, metrics = self.critic_step(batch["batch"])
        if warming_up and self.critic is not None:
            return {"meta_info": {"metrics": {**_idle_actor_metrics(), **metrics}}}
        if warming_up:  # the value head on the policy trains alone
            actor_batch[VALUE_WARMUP] = torch.ones(actor_batch["responses"].shape[0])
            metrics = {**_idle_actor_metrics(), **metrics}
        answer = self.actor.update_actor({"batch": actor_batch, "meta_info": batch.get("meta_info", {})})
        answer.setdefault("meta_info", {}).setdefault("metrics", {}).update(metrics)
        return answer

    def start_update_actor(self, batch: dict[str, Any], export_path: str) -> UpdateInFlight:
        warming_up = self._warming_up()
        actor_batch, metrics = self.critic_step(batch["batch"])
        if warming_up and self.critic is not None:
            # the actor is not trained: the engines get its weights again as this version
            if export_path:
                self.actor.export_weights(export_path)
            return _DoneUpdate(
                {"meta_info": {"metrics": {**_idle_actor_metrics(), **metrics}, "export_s": 0.0}}
            )
        if warming_up:  # the value head on the policy trains alone; the export is the policy's
            actor_batch[VALUE_WARMUP] = torch.ones(actor_batch["responses"].shape[0])
            metrics = {**_idle_actor_metrics(), **metrics}
        update = self.actor.start_update_actor(
            {"batch": actor_batch, "meta_info": batch.get("meta_info", {})}, export_path
        )
        return _WithCriticMetrics(update, metrics)

    # --- everything else is the actor's (checkpoints: both) -------------------------------------
    def compute_log_prob(self, batch: dict[str, Any]) -> dict[str, Any]:
        return self.actor.compute_log_prob(batch)

    def save_checkpoint(self, local_path: str, global_step: int, save_weight_only: bool = False) -> None:
        self.actor.save_checkpoint(local_path, global_step, save_weight_only)
        if save_weight_only:
            return
        critic_dir = os.path.join(local_path, CRITIC_DIR)
        if self.critic is not None:
            self.critic.save_checkpoint(critic_dir, global_step)
        else:  # a value head on the policy: its weights are in the actor's files, its progress here
            os.makedirs(critic_dir, exist_ok=True)
        with open(os.path.join(critic_dir, UPDATES_FILE), "w") as f:
            json.dump({"critic_updates": self.critic_updates}, f)

    def load_checkpoint(self, local_path: str, load_optimizer: bool = True) -> None:
        critic_dir = os.path.join(local_path, CRITIC_DIR)
        if not os.path.isfile(os.path.join(critic_dir, UPDATES_FILE)):
            raise FileNotFoundError(
                f"{critic_dir}: no critic in this checkpoint (saved by a run without "
                "algorithm.adv_estimator=gae?); a PPO run resumes only from a PPO run's checkpoint"
            )
        if self.critic is not None and not os.path.isdir(os.path.join(critic_dir, "model")):
            raise FileNotFoundError(
                f"{critic_dir}: no critic model in this checkpoint (saved by a run with "
                "service.train_service.critic.head_on_policy=true: resume with it)"
            )
        self.actor.load_checkpoint(local_path, load_optimizer)  # a value head: checked there
        if self.critic is not None:
            self.critic.load_checkpoint(critic_dir, load_optimizer)
        with open(os.path.join(critic_dir, UPDATES_FILE)) as f:
            self.critic_updates = int(json.load(f)["critic_updates"])

    def export_weights(self, path: str) -> None:
        self.actor.export_weights(path)

    def broadcast_weights(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self.actor.broadcast_weights(spec)

    def health(self) -> bool:
        return self.actor.health() and (self.critic is None or self.critic.health())

    def close(self) -> None:
        self.actor.close()
        if self.critic is not None:
            self.critic.close()


def _idle_actor_metrics() -> dict[str, Any]:
    """The actor's metrics of a critic warm-up step: nothing trained."""
    return {
        "actor/loss": 0.0,
        "actor/pg_loss": 0.0,
        "actor/grad_norm": 0.0,
        "actor/nan_skipped": 0,
        "actor/optimizer_steps": 0,
        "critic/warmup": 1.0,
    }
