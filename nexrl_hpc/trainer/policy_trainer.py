"""The policy trainer: the PPO/GRPO update that every trainer rank runs, whatever the parallelism.

Behind ``service.train_service.backend=local`` in this process, and on each rank of a trainer group
(an MPI job's trainer ranks, a standalone service's torchrun workers).

Each micro-batch's loss is ``algorithm.loss.ActorLoss`` (the policy loss with the dual clip and a
log-ratio clamp, an optional entropy bonus, optional KL to a frozen reference); mini-batches (one
optimizer step each) split into micro-batches whose gradients accumulate with a mini-batch-wide
normaliser, grad-norm clipping, AdamW, linear LR warm-up then constant or cosine. A non-finite loss or
gradient skips that optimizer step and is reported in the metrics (``actor/nan_skipped``).
The parallelism (one process, FSDP2 or DeepSpeed ZeRO over the trainer ranks) is a ``ParallelStrategy``: every
rank runs this same code on its slice of each mini-batch, with the same number of forward/backward
passes (a rank short of rows runs a zero-weighted pass: the collectives must line up).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from nexrl_hpc.algorithm.loss import ActorLoss, LossInputs
from nexrl_hpc.checkpoint.trainer_io import TrainerCheckpointIO, tied_weight_names
from nexrl_hpc.models.tiny import load_model
from nexrl_hpc.models.value_head import VALUE_HEAD, attach_value_head, is_value_head_name
from nexrl_hpc.trainer.backend import TrainBackend
from nexrl_hpc.trainer.batch_plan import plan_batch
from nexrl_hpc.trainer.logprobs import logit_temperature, response_log_probs, response_log_probs_and_entropy
from nexrl_hpc.trainer.lora import learning_rate, lora_enabled, reference_log_probs, wrap_with_lora
from nexrl_hpc.trainer.loss_sums import LossSums
from nexrl_hpc.trainer.memory_metrics import peak_memory_metrics
from nexrl_hpc.trainer.packing import packed_response_log_probs_and_entropy
from nexrl_hpc.trainer.parallel import ParallelStrategy
from nexrl_hpc.trainer.sequence_parallel import enable_sequence_parallel, new_sequence_parallel_group
from nexrl_hpc.trainer.strategy_factory import create_parallel_strategy
from nexrl_hpc.trainer.value_head import (
    NO_VALUE_HEAD,
    VALUE_QUERY,
    ValueHeadLoss,
    captured_values,
    drop_all_but_the_value_heads_gradients,
    value_head_of_update,
)
from nexrl_hpc.trainer.weight_broadcast import broadcast_weights

logger = logging.getLogger(__name__)


def enable_activation_checkpointing(model: Any) -> None:
    """``model.gradient_checkpointing``: every decoder layer recomputes its activations in backward.
    Non-reentrant (works under FSDP2/DeepSpeed and with inputs that need no grad). transformers 5
    renamed the method; 4.x has only the old name."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def master_dtype(engine: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype the trainer loads the weights in: fp32 masters whatever the compute dtype, which the
    forward passes take through autocast (single) or FSDP2's ``param_dtype`` all-gathers; so an
    update far below a bf16 ulp (lr 1e-6) still moves the weights, and AdamW's state is fp32 too.
    DeepSpeed casts the module to bf16 itself and keeps the fp32 masters in its optimizer."""
    return compute_dtype if engine == "deepspeed" else torch.float32


def lr_factor(step: int, warmup: int, schedule: str, total: int, min_ratio: float) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        span = max(total - warmup, 1)
        progress = min(max(step - warmup, 0) / span, 1.0)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


@dataclass
class MicroBatch:
    """One forward/backward's rows: their tensors, whether they are real (not a stand-in pass), their
    rows in the rank's shard, and their bins (row lists of ``tensors``; one row each unless packed)."""

    tensors: dict[str, torch.Tensor]
    real: bool
    rows: torch.Tensor
    bins: list[list[int]]
    shared_prompts: bool  # bins are families packed as their prompt once (the plan's choice)


class PolicyTrainer(TrainBackend):
    """The model, its optimizer and LR schedule on one trainer rank, and the PPO update over them.

    A trainer group's rank 0 splits each batch with ``plan_batch`` and every rank runs the
    ``*_shard`` methods on its part; in one process ``compute_log_prob``/``update_actor`` do both.
    """

    def __init__(self, base_model_dir: str | None = None, engine: str | None = None):
        self._base_model_dir = base_model_dir
        self._engine = engine  # a standalone worker's --backend: overrides the client's choice
        self._cfg: dict[str, Any] | None = None
        self.model: Any = None
        self.ref_model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.device = torch.device("cpu")
        self.parallel: ParallelStrategy | None = None
        self._incomplete_load: str | None = None  # why the last load left the state half replaced
        self._role = "actor"
        self._lora = False  # actor.lora.rank > 0: the model is a PeftModel
        self._value_head: dict[str, Any] | None = None  # PPO's value head on the policy: its loss settings

    # --- lifecycle ------------------------------------------------------------------------------
    def initialize_worker(
        self, config_dict: dict[str, Any], role: str = "actor", world_size: int = 1
    ) -> None:
        if self._engine is not None:
            config_dict = dict(config_dict, engine=self._engine)
        engine = config_dict["engine"]
        if engine == "single" and world_size != 1:
            raise ValueError(
                f"service.train_service.engine=single runs one process; got world_size={world_size}"
            )
        self._world_size = world_size
        self._role = role  # "teacher": on-policy distillation's frozen scorer (compute_log_prob only)
        self._cfg = config_dict
        if config_dict.get("model_path"):  # trainer ranks of a service learn the model from the client
            self._base_model_dir = config_dict["model_path"]
        torch.set_num_threads(config_dict["num_threads"])

    def init_model(self) -> None:
        cfg = self._require_cfg()
        if cfg["device"] == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("service.train_service.device=cuda but no CUDA device is visible")
        self.device = torch.device(cfg["device"])
        compute_dtype = getattr(torch, cfg["dtype"])
        if self._base_model_dir is None:
            raise ValueError("initialize_worker: no model_path in the config and no base model given")
        self.model = self._load_model(self._base_model_dir, master_dtype(cfg["engine"], compute_dtype))
        self.model.train()
        if cfg["gradient_checkpointing"]:
            enable_activation_checkpointing(self.model)
        self._lora = lora_enabled(cfg["actor"]) and self._role == "actor"  # never a teacher
        if self._lora:
            self.model = wrap_with_lora(self.model, cfg["actor"]["lora"])
        elif cfg["algorithm"]["kl_loss_coef"] > 0:  # a frozen, unsharded copy on every rank
            # in the compute dtype: it is never updated, so it needs no fp32 master
            self.ref_model = copy.deepcopy(self.model).to(compute_dtype).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self._value_head = cfg.get("value_head") if self._role == "actor" else None
        if self._value_head is not None:  # before the engine wraps the model: it shards the head too
            attach_value_head(self.model)
        self.parallel = create_parallel_strategy(cfg["engine"], cfg, self.device, self._world_size)
        if self.parallel.world_size != self._world_size:
            raise ValueError(
                f"service.train_service.world_size={self._world_size} but {self.parallel.world_size} "
                "trainer rank(s) are running"
            )
        optim = cfg["actor"]["optim"]

        def make_optimizer(params: Any) -> torch.optim.Optimizer:
            return torch.optim.AdamW(
                params,
                lr=learning_rate(cfg["actor"]),
                betas=tuple(optim["betas"]),
                eps=optim["eps"],
                weight_decay=optim["weight_decay"],
            )

        self.model, self.optimizer = self.parallel.setup(self.model, make_optimizer)
        if cfg["sequence_parallel_size"] > 1:
            self._enable_sequence_parallel(cfg)
        warmup, schedule = optim["lr_warmup_steps"], optim["lr_scheduler"]
        total, min_ratio = cfg["total_training_steps"], optim["min_lr_ratio"]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup, schedule, total, min_ratio)
        )

    def _load_model(self, model_dir: str, dtype: torch.dtype) -> Any:
        """The model this trainer trains (a causal LM; the critic's trainer loads a value model)."""
        cfg = self._require_cfg()
        return load_model(
            model_dir, dtype=dtype, device=self.device, attn_implementation=cfg["attn_implementation"]
        )

    def _enable_sequence_parallel(self, cfg: dict[str, Any]) -> None:
        """Ulysses over groups of ``sequence_parallel_size`` ranks (``trainer.sequence_parallel``),
        for the trained model and the frozen reference."""
        size = cfg["sequence_parallel_size"]
        if cfg["engine"] != "fsdp":
            raise ValueError(
                f"service.train_service.sequence_parallel_size={size} needs engine=fsdp, not {cfg['engine']}"
            )
        assert self.parallel is not None
        group, rank = new_sequence_parallel_group(size)
        self.parallel.sequence_parallel_size = size
        for model in (self.model, self.ref_model):
            if model is not None:
                enable_sequence_parallel(model, group, size, rank)
        logger.info(
            "sequence parallelism: %d ranks split each sequence (this rank: %d of its group)", size, rank
        )

    def _compute(self) -> torch.autocast:
        """Forward passes in ``service.train_service.dtype`` over fp32 master weights (autocast: the
        matmuls in bf16, reductions and the residual stream in fp32). Off in fp32, and under
        DeepSpeed, which holds the module in bf16 itself (its optimizer keeps the fp32 masters)."""
        cfg = self._require_cfg()
        dtype = getattr(torch, cfg["dtype"])
        enabled = dtype != torch.float32 and cfg["engine"] != "deepspeed"
        return torch.autocast(device_type=self.device.type, dtype=dtype, enabled=enabled)

    def _require_parallel(self, loading: bool = False) -> ParallelStrategy:
        if self.parallel is None:
            raise RuntimeError("init_model must be called before training")
        if self._incomplete_load is not None and not loading:
            raise RuntimeError(
                f"the last load_checkpoint failed halfway: {self._incomplete_load}; load a checkpoint again"
            )
        return self.parallel

    def _require_cfg(self) -> dict[str, Any]:
        if self._cfg is None:
            raise RuntimeError("initialize_worker must be called before init_model")
        return self._cfg

    # --- how a batch is split over the trainer ranks --------------------------------------------
    def plan_batch(
        self, operation: str, tensors: dict[str, Any]
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Split a whole batch for the trainer ranks: (plan, one shard per rank); see ``batch_plan``."""
        cfg = self._require_cfg()
        sp = cfg["sequence_parallel_size"]
        return plan_batch(operation, tensors, cfg["actor"], self._world_size, self.model, sp)

    def _micro(
        self, shard: dict[str, Any], lo: int, batches: list[Any], index: int, shared_prompts: bool
    ) -> MicroBatch:
        """Micro-batch ``index`` of the mini-batch slice starting at shard row ``lo`` (``batches``: its
        planned micro-batches, bins of slice rows); a stand-in row (not real) when this rank has none left."""
        real = index < len(batches)
        bins = batches[index] if real else [[0]]
        rows = [lo + i for members in bins for i in members] if real else [0]
        position: dict[int, int] = {}  # slice row -> row of the micro-batch
        for members in bins:
            for i in members:
                position[i] = len(position)
        index_t = torch.tensor(rows, dtype=torch.long)
        part = {
            k: v.index_select(0, index_t).to(self.device)
            for k, v in shard.items()
            if isinstance(v, torch.Tensor)
        }
        bins_of_part = [[position[i] for i in members] for members in bins]
        return MicroBatch(part, real, index_t, bins_of_part, shared_prompts)

    def _log_probs(
        self, micro: MicroBatch, with_entropy: bool, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response log-probs (and entropy) of a micro-batch: packed (``actor.packing``), packed by
        shared prompts (the plan's choice under ``actor.share_prompt``) or padded."""
        part = micro.tensors
        cfg = self._require_cfg()
        chunk, temperature = cfg["logprob_chunk_tokens"], logit_temperature(cfg, part)
        with self._compute():
            if cfg["actor"]["packing"] or micro.shared_prompts:
                return packed_response_log_probs_and_entropy(
                    self.model,
                    part,
                    with_entropy,
                    entropy_grad,
                    micro.bins,
                    share_prompt=micro.shared_prompts,
                    chunk_tokens=chunk,
                    temperature=temperature,
                )
            if not with_entropy:
                return response_log_probs(self.model, part, chunk, temperature), None
            return response_log_probs_and_entropy(self.model, part, entropy_grad, chunk, temperature)

    def _values_captured(self, micro: MicroBatch) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """``captured_values`` around the policy's forward (the padded layout only)."""
        if self._value_head is None:
            raise ValueError(NO_VALUE_HEAD)
        if self._require_cfg()["actor"]["packing"] or micro.shared_prompts:
            raise ValueError(
                "a value head on the policy reads the padded layout: set service.train_service.actor."
                "packing=false and share_prompt=false"
            )
        model = self._require_parallel().unwrap(self.model)
        return captured_values(self.model, getattr(model, VALUE_HEAD))

    # --- compute (whole batch: single process, or every rank holding the whole batch) -----------
    def compute_log_prob(self, batch: dict[str, Any]) -> dict[str, Any]:
        par = self._require_parallel()
        plan, shards = self.plan_batch("compute_log_prob", batch["batch"])
        local = self.compute_log_prob_shard(shards[par.rank], plan)
        return {"batch": {"old_log_probs": par.all_gather_rows(local, plan["counts"][0])}, "meta_info": {}}

    def update_actor(self, batch: dict[str, Any]) -> dict[str, Any]:
        par = self._require_parallel()
        plan, shards = self.plan_batch("update_actor", batch["batch"])
        return {"meta_info": {"metrics": self.update_actor_shard(shards[par.rank], plan)}}

    # --- compute on this rank's shard -----------------------------------------------------------
    @torch.no_grad()
    def compute_log_prob_shard(self, shard: dict[str, Any], plan: dict[str, Any]) -> torch.Tensor:
        """Log-probs of this rank's real rows, [rows, R]; with a ``VALUE_QUERY`` column, the value
        head's V instead (PPO's values from a head on the policy)."""
        par = self._require_parallel()
        was_training = self.model.training
        self.model.eval()
        out = torch.zeros((plan["counts"][0][par.rank], shard["responses"].shape[1]))
        for i in range(plan["passes"][0]):
            micro = self._micro(shard, 0, plan["micro"][0][par.rank], i, plan["shared_prompts"])
            if VALUE_QUERY in shard:
                with self._values_captured(micro) as values:
                    self._log_probs(micro, with_entropy=False)
                score = values[-1].cpu()
            else:
                score = self._log_probs(micro, with_entropy=False)[0].cpu()
            if micro.real:
                out[micro.rows] = score  # packed micro-batches hold their rows in bin order
        self.model.train(was_training)
        return out

    def update_actor_shard(self, shard: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
        """One training step over this rank's shard; the metrics are global (reduced over ranks)."""
        if self._role == "teacher":
            raise RuntimeError(
                "this trainer group holds the distillation teacher: it scores, it is not trained"
            )
        cfg = self._require_cfg()
        par = self._require_parallel()
        actor = cfg["actor"]
        loss_fn = ActorLoss.from_config(actor, cfg["algorithm"])
        assert self.optimizer is not None and self.scheduler is not None
        sums = LossSums()  # this rank's
        value_head, value_warmup = value_head_of_update(shard, self._value_head, actor, cfg["engine"])
        grad_norms: list[float] = []
        nan_skipped = 0
        mismatch_max = 0.0
        for _ in range(actor["ppo_epochs"]):
            lo = 0
            for counts, normalizer, passes, ranges in zip(
                plan["counts"], plan["normalizers"], plan["passes"], plan["micro"]
            ):
                par.zero_grad(self.model, self.optimizer)
                for i in range(passes):
                    micro = self._micro(shard, lo, ranges[par.rank], i, plan["shared_prompts"])
                    mismatch = self._train_micro_batch(
                        micro,
                        loss_fn,
                        normalizer,
                        sums,
                        i == passes - 1,
                        first_step=not grad_norms,
                        value_head=value_head,
                        value_warmup=value_warmup,
                    )
                    mismatch_max = max(mismatch_max, mismatch)
                if value_warmup:
                    drop_all_but_the_value_heads_gradients(par.unwrap(self.model))
                grad_norm, stepped = par.step(self.model, self.optimizer, actor["grad_clip"])  # global norm
                if not stepped:
                    nan_skipped += 1
                    logger.warning("non-finite loss or gradient: optimizer step skipped")
                grad_norms.append(grad_norm)
                lo += counts[par.rank]
        lr = self.scheduler.get_last_lr()[0]
        with (
            warnings.catch_warnings()
        ):  # a step whose optimizer steps were all skipped still advances the schedule
            warnings.simplefilter("ignore", UserWarning)
            if not value_warmup:  # the policy's schedule counts the policy's updates
                self.scheduler.step()
        steps_done = len(grad_norms)
        metrics: dict[str, Any] = {
            **sums.all_reduced(par).metrics(
                steps_done, cfg["algorithm"]["kl_loss_coef"], actor["entropy_coeff"]
            ),
            "actor/grad_norm": sum(grad_norms) / len(grad_norms),
            "actor/lr": lr,
            "actor/nan_skipped": nan_skipped,
            "actor/optimizer_steps": steps_done - nan_skipped,
        }
        if "behaviour_log_probs" in shard:
            metrics["actor/logprob_mismatch_max"] = par.all_reduce_max(mismatch_max)
        if value_head is not None:  # as the separate critic's metrics (trainer/critic.py)
            metrics.update(value_head.metrics(par, steps_done))
        for key, value in peak_memory_metrics(self.device).items():  # the largest rank's
            metrics[key] = par.all_reduce_max(value)
        return metrics

    def _train_micro_batch(
        self,
        micro: MicroBatch,
        loss_fn: ActorLoss,
        normalizer: float | None,
        sums: LossSums,
        last_in_step: bool,
        first_step: bool,
        value_head: ValueHeadLoss | None = None,
        value_warmup: bool = False,
    ) -> float:
        """Forward, the loss, backward of one micro-batch (its sums added when it is real); returns
        the largest |log-prob - behaviour log-prob| of its tokens in the first optimizer step (0 else).
        ``value_head`` (the batch has ``values`` and ``returns``): a value head on the policy trains
        in the same backward, the loss adding its term; ``value_warmup``: that term alone
        (``update_actor_shard`` keeps only the head's gradients)."""
        par = self._require_parallel()
        part = micro.tensors
        capture: contextlib.AbstractContextManager[list[torch.Tensor]] = contextlib.nullcontext([])
        if value_head is not None:
            capture = self._values_captured(micro)
        with capture as values:
            log_prob, entropy = self._log_probs(
                micro, with_entropy=True, entropy_grad=loss_fn.entropy_needs_grad
            )
        assert entropy is not None
        mismatch = 0.0
        if first_step and micro.real and "behaviour_log_probs" in part:
            diff = (log_prob.detach() - part["behaviour_log_probs"]).abs() * part["response_mask"]
            mismatch = float(diff.max()) if diff.numel() else 0.0
        ref_log_prob = None
        cfg = self._require_cfg()
        chunk, temperature = cfg["logprob_chunk_tokens"], logit_temperature(cfg, part)
        if self.ref_model is not None:
            with torch.no_grad(), self._compute():
                ref_log_prob = response_log_probs(self.ref_model, part, chunk, temperature)
        elif self._lora and loss_fn.kl_penalty.coeff > 0:
            with self._compute():
                ref_log_prob = reference_log_probs(self.model, response_log_probs, part, chunk, temperature)
        loss, terms = loss_fn(LossInputs(log_prob, entropy, part, normalizer, ref_log_prob))
        if value_head is not None:
            value_term = value_head(values[-1], part, normalizer, micro.real)
            loss = value_term if value_warmup else loss + value_term
        weight = par.loss_scale() if micro.real else 0.0  # a stand-in pass adds nothing
        # a non-finite loss shows up in the grad norm of the step
        par.backward(self.model, loss * weight, last_in_step=last_in_step)
        if micro.real and not value_warmup:
            sums.add(LossSums(**{name: float(value) for name, value in terms.items()}))
        return mismatch

    # --- weights and checkpoints (the files: ``checkpoint.trainer_io``) -------------------------
    def _checkpoint_io(self, par: ParallelStrategy) -> TrainerCheckpointIO:
        cfg = self._require_cfg()
        assert self._base_model_dir is not None  # init_model does not start without it
        return TrainerCheckpointIO(
            par,
            self.model,
            self.optimizer,
            self.scheduler,
            engine=cfg["engine"],
            base_model_dir=self._base_model_dir,
            max_shard_bytes=cfg["export_max_shard_mb"] << 20,
        )

    def export_weights(self, path: str) -> None:
        io = self._checkpoint_io(self._require_parallel())
        io.write_model(path, fsync=False, tied_head=self._require_cfg()["export_tied_head"])

    def broadcast_weights(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The weights to the engines of one sync (weight.transport=broadcast), a tied weight once."""
        par = self._require_parallel()
        model = par.unwrap(self.model)
        skip = set(tied_weight_names(model)) | {k for k in model.state_dict() if is_value_head_name(k)}
        return broadcast_weights(par, self.model, spec, skip)

    def save_checkpoint(self, local_path: str, global_step: int, save_weight_only: bool = False) -> None:
        self._checkpoint_io(self._require_parallel()).save(local_path, global_step, save_weight_only)

    def load_checkpoint(self, local_path: str, load_optimizer: bool = True) -> None:
        """Weights load at any world size; optimizer state at the layout that wrote it, or resharded
        between any world sizes of engines single, fsdp and ZeRO-3 (``checkpoint.reshard``) — else
        the error says so. Names, shapes and
        layout are checked before a tensor byte is read, so a wrong checkpoint changes nothing; a
        load that fails after that leaves this trainer refusing to train until a load succeeds."""
        par = self._require_parallel(loading=True)
        io = self._checkpoint_io(par)
        files = io.files(local_path)
        io.check(files, load_optimizer)  # every rank loads, or none does
        assert self.optimizer is not None and self.scheduler is not None
        try:
            io.load(files, load_optimizer)
        except Exception as exc:  # past the checks: live weights or optimizer state may be half replaced
            self._incomplete_load = f"rank {par.rank}: {type(exc).__name__}: {exc}"
            raise
        self._incomplete_load = None
