"""TypedDict schema of ``service.train_service``: the trainer group (engine, world size, transport),
its PPO actor, optimizer and parallel engines, and on-policy distillation's teacher service.
Part of the config tree typed in ``nexrl_hpc.config.schema``."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypedDict

from nexrl_hpc.config.algorithm_names import PolicyLossName
from nexrl_hpc.config.constraints import Ge, Gt, Le


class OptimConfig(TypedDict):
    lr: Annotated[float, Gt(0.0)]
    betas: list[float]
    eps: Annotated[float, Gt(0.0)]
    weight_decay: Annotated[float, Ge(0.0)]
    lr_warmup_steps: Annotated[int, Ge(0)]
    lr_scheduler: Literal["constant", "cosine"]
    min_lr_ratio: Annotated[float, Ge(0.0), Le(1.0)]


class LoraConfig(TypedDict):
    rank: Annotated[int, Ge(0)]  # 0: full fine-tuning
    alpha: Annotated[int, Ge(1)]
    dropout: Annotated[float, Ge(0.0), Le(1.0)]
    target_modules: str | list[str]  # "all-linear" or module names (peft's target_modules)
    modules_to_save: list[str] | Literal["auto"] | None  # auto: trainer.lora.resolved_actor
    lr: Annotated[float, Gt(0.0)]  # the optimizer's lr when rank > 0


class ActorConfig(TypedDict):
    ppo_epochs: Annotated[int, Ge(1)]
    ppo_mini_batch_size: Annotated[int, Ge(1)]
    ppo_micro_batch_size: Annotated[int, Ge(1)]
    ppo_max_token_len_per_gpu: Annotated[int, Ge(1)] | None  # micro-batches by real tokens; null: by rows
    packing: bool  # sequences packed end to end (no padding computed); false: padded rows
    # rows with one prompt packed as that prompt once + each response (4-D mask); auto: when it is cheaper
    share_prompt: bool | Literal["auto"]
    grad_clip: Annotated[float, Gt(0.0)]
    clip_ratio_low: Annotated[float, Ge(0.0), Le(1.0)]
    clip_ratio_high: Annotated[float, Ge(0.0)]
    clip_ratio_c: Annotated[float, Gt(1.0)] | None  # dual clip: A < 0 token loss <= -A * c; null: off
    log_ratio_clamp: Annotated[float, Gt(0.0)] | None  # |log ratio| bound before exp; null: off
    entropy_coeff: Annotated[float, Ge(0.0)]  # loss -= coeff * entropy; 0: no entropy gradient
    policy_loss: PolicyLossName  # one of its values: token-level PPO-clip | GSPO's sequence-level ratio
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ]
    loss_norm_tokens: Annotated[int, Ge(1)]  # seq-mean-token-sum-norm's constant (the response budget)
    optim: OptimConfig
    lora: LoraConfig


class CriticConfig(TypedDict):
    model_path: str | None  # the value model's HF directory; null: the policy's initial model
    world_size: Annotated[int, Ge(1)]  # mpi mode: the critic group's ranks; local mode: 1 (this process)
    engine: Literal["single", "fsdp", "deepspeed"]
    ppo_epochs: Annotated[int, Ge(1)]
    ppo_mini_batch_size: Annotated[int, Ge(1)]
    ppo_micro_batch_size: Annotated[int, Ge(1)]
    cliprange_value: Annotated[float, Gt(0.0)] | None  # null: the unclipped squared error
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ]
    grad_clip: Annotated[float, Gt(0.0)]
    warmup_steps: Annotated[int, Ge(0)]  # updates that train only the critic (verl's trainer.critic_warmup)
    optim: OptimConfig
    head_on_policy: bool  # true: a value head on the policy model (one trunk, the actor's optimizer)
    vf_coef: Annotated[float, Gt(0.0)]  # head_on_policy: the value loss's weight in the actor's loss


class FSDPConfig(TypedDict):
    param_dtype: Literal["float32", "bfloat16"]
    reduce_dtype: Literal["float32", "bfloat16"]


class TrainServiceTimeouts(TypedDict):
    zmq_recv_timeout_ms: Annotated[int, Ge(1)]
    zmq_total_timeout_ms: Annotated[int, Ge(1)]


class DeepSpeedConfig(TypedDict):
    zero_stage: Annotated[int, Ge(0), Le(3)]
    config: dict[str, Any]  # raw DeepSpeed keys, merged over the generated config


class TeacherServiceConfig(TypedDict):
    identifier: str
    backend: Literal["local", "direct-zmq"]
    url: str | None
    world_size: Annotated[int, Ge(1)]
    engine: Literal["single", "fsdp", "deepspeed"]


class TrainServiceConfig(TypedDict):
    backend: Literal["local", "noop", "direct-zmq"]  # noop: trains nothing (data-path benchmarks)
    url: str | None
    token_env: str
    model_tag: str
    identifier: str
    world_size: Annotated[int, Ge(1)]
    sequence_parallel_size: Annotated[int, Ge(1)]  # ranks splitting each sequence (Ulysses)
    config: TrainServiceTimeouts
    connect_timeout_s: Annotated[float, Gt(0.0)]
    heartbeat_timeout_s: Annotated[float, Gt(0.0)]
    collective_timeout_s: Annotated[float, Gt(0.0)]
    idle_tick_s: Annotated[float, Gt(0.0)]
    engine: Literal["single", "fsdp", "deepspeed"]
    fsdp: FSDPConfig
    deepspeed: DeepSpeedConfig
    num_threads: Annotated[int, Ge(1)]
    teacher_service: TeacherServiceConfig
    device: Literal["cpu", "cuda"]
    dtype: Literal["float32", "bfloat16"]
    dist_backend: Literal["gloo", "nccl"]  # torch.distributed backend of the trainer group
    export_max_shard_mb: Annotated[int, Ge(1)]
    logprob_chunk_tokens: Annotated[int, Ge(0)]  # LM head positions per chunk; 0: materialised log-softmax
    actor: ActorConfig
    critic: CriticConfig  # algorithm.adv_estimator=gae (algorithm=ppo)
