"""TypedDict schemas of the whole config tree (YAML holds the defaults, TypedDicts type them).

Every key the code reads is declared here; ``nexrl_hpc.config.validate`` checks a composed config
against these before anything is built or submitted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypedDict

from nexrl_hpc.config.constraints import Ge, Gt, Le


class TokenizerConfig(TypedDict):
    alphabet: str  # characters of the char-level tokenizer (special tokens are added)
    chat_template: str | None  # Jinja chat template (agent workflows send chat requests); null: none


class TinyModelConfig(TypedDict):
    architecture: Literal["llama"]
    hidden_size: Annotated[int, Ge(1)]
    intermediate_size: Annotated[int, Ge(1)]
    num_hidden_layers: Annotated[int, Ge(1)]
    num_attention_heads: Annotated[int, Ge(1)]
    num_key_value_heads: Annotated[int, Ge(1)]
    max_position_embeddings: Annotated[int, Ge(2)]
    tie_word_embeddings: bool
    init_seed: int
    tokenizer: TokenizerConfig
    warmup: str | None  # "module:function"(model, tokenizer, seed, **warmup_args) run on the fresh model
    warmup_args: dict[str, Any]  # keyword arguments of the warm-up (e.g. the task's characters)


class ModelConfig(TypedDict):
    path: str | None  # HF-layout model directory; null builds the tiny model below
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"]
    gradient_checkpointing: bool  # the trainer recomputes activations in backward (less memory)
    tiny: TinyModelConfig


class TaskConfig(TypedDict):
    name: str
    generator: str | None  # "module:function" building {"train": rows, "validation": rows}
    reward_fn: str  # "module:function"(task_row, response_text) -> float | dict
    alphabet: str
    params: dict


class DataConfig(TypedDict):
    type: Literal["task", "jsonl", "parquet", "hf"]
    split: str  # the split of an HF DatasetDict folder (type=hf)
    data_files: list[str]
    hf_builder: str | None  # type=hf data files: the datasets builder; null: from the file extension
    prompt_key: str  # dotted paths into nested rows
    answer_key: str | None  # null: rows carry no ground truth
    id_key: str | None
    apply_chat_template: bool  # string prompts too go through the chat template (as one user message)
    add_generation_prompt: bool
    batch_size: Annotated[int, Ge(1)]
    rollout_repeat_n: Annotated[int, Ge(1)]
    shuffle: bool
    seed: int
    max_epochs: Annotated[int, Ge(1)] | None


class ValKwargs(TypedDict):
    temperature: Annotated[float, Ge(0.0)]
    top_p: Annotated[float, Gt(0.0), Le(1.0)]


class AgentRolloutConfig(TypedDict):
    """rollout_worker.type=agent: one workflow episode per task (the agent model, nexrl_hpc.agents)."""

    workflow: str  # "module:Class", a nexrl_hpc.agents.workflow.Workflow subclass
    agent_cls: str  # "module:Class", a BaseAgent subclass (workflow arg agent_cls)
    env_cls: str  # "module:Class", a BaseEnv subclass (workflow arg env_cls)
    agent_args: dict  # constructor kwargs of agent_cls
    env_args: dict  # env_cls.from_dict args; reward_fn defaults to rollout_worker.reward_fn
    tools: list[str]  # registry tool names given to agent and env (when they take ``tools``)
    tool_map: dict  # tool name -> "module:Class" given to agent and env (when they take ``tool_map``)
    max_turns: Annotated[int, Ge(1)]  # model turns per episode (workflow max_steps)
    max_episode_length: Annotated[int, Ge(1)] | None  # tokens after the first prompt; null: no limit
    gamma: Annotated[float, Ge(0.0), Le(1.0)]  # discount of the per-step Monte Carlo returns
    reward_bonus_coeff: float
    timeout_s: Annotated[float, Gt(0.0)] | None  # wall time of one episode; null: no limit
    retry_limit: Annotated[int, Ge(1)]  # attempts per episode; only ERROR episodes are retried
    workflow_args: dict  # more kwargs of the workflow class


class RolloutWorkerConfig(TypedDict):
    type: Literal["simple", "single_turn", "agent"]
    num_workers: Annotated[int, Ge(1)]
    max_concurrency: Annotated[int, Ge(1)]
    fetch_size: Annotated[int, Ge(1)]  # tasks taken from the loader per call (spreads a batch over workers)
    temperature: Annotated[float, Ge(0.0)]
    top_p: Annotated[float, Gt(0.0), Le(1.0)]
    max_prompt_length: Annotated[int, Ge(1)]
    max_response_length: Annotated[int, Ge(1)]
    reward_fn: str
    val_kwargs: ValKwargs
    agent: AgentRolloutConfig
    long_poll_s: Annotated[
        float, Gt(0.0)
    ]  # longest wait for work in one call (returns early when work comes)
    stop_timeout_s: Annotated[float, Gt(0.0)]  # stop() waits this long for the worker loop


class TrajectoryPoolConfig(TypedDict):
    type: Literal["default"]
    batch_size: Annotated[int, Ge(1)]
    group_size: Annotated[int, Ge(1)]
    key_list: list[str]
    check_batch_ready_function: str  # batch_size | loaded_batch_finished | "module:function"


class AlgorithmConfig(TypedDict):
    type: Literal["grpo"]
    norm_adv_by_std: bool
    adv_epsilon: Annotated[float, Ge(0.0)]
    advantage_granularity: Literal["episode", "step"]  # step: per-turn returns (agent rollouts)
    recompute_old_log_prob: bool
    off_policy_correction: Literal["none", "decoupled", "tis"]
    is_cap: Annotated[float, Gt(1.0)] | None
    kl_loss_coef: Annotated[float, Ge(0.0)]
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"]
    long_poll_s: Annotated[
        float, Gt(0.0)
    ]  # longest wait for work in one call (returns early when work comes)
    stop_timeout_s: Annotated[float, Gt(0.0)]  # stop() waits this long for the processing loop
    full_queue_poll_s: Annotated[float, Gt(0.0)]  # train batch queue full: offer the batch again after this


class TrainBatchPoolConfig(TypedDict):
    type: Literal["default"]
    max_queue_size: Annotated[int, Ge(1)]


class TrainWorkerConfig(TypedDict):
    type: Literal["default"]
    total_train_steps: Annotated[int, Ge(1)]
    num_workers: Annotated[int, Ge(1), Le(1)]
    save_freq: Annotated[int, Ge(0)]
    checkpoint_path: str
    sync_weight_path: str
    remove_previous_ckpt: bool
    max_ckpt_to_keep: Annotated[int, Ge(1)] | None
    long_poll_s: Annotated[
        float, Gt(0.0)
    ]  # longest wait for work in one call (returns early when work comes)
    stop_timeout_s: Annotated[float, Gt(0.0)]  # stop() waits this long for the training loop


class WeightConfig(TypedDict):
    type: Literal["default"]
    sync_mode: Literal["sync", "fully-async", "batch-async"]  # see weight_sync/controller.py
    staleness_threshold: Annotated[int, Ge(0)]
    stale_policy: Literal["drop", "keep"]
    sync_method: Literal["disk"]
    sync_weight_path: str
    validate_freq: Annotated[int, Ge(0)]
    keep_versions: Annotated[int, Ge(1)]


class OptimConfig(TypedDict):
    lr: Annotated[float, Gt(0.0)]
    betas: list[float]
    eps: Annotated[float, Gt(0.0)]
    weight_decay: Annotated[float, Ge(0.0)]
    lr_warmup_steps: Annotated[int, Ge(0)]
    lr_scheduler: Literal["constant", "cosine"]
    min_lr_ratio: Annotated[float, Ge(0.0), Le(1.0)]


class ActorConfig(TypedDict):
    ppo_epochs: Annotated[int, Ge(1)]
    ppo_mini_batch_size: Annotated[int, Ge(1)]
    ppo_micro_batch_size: Annotated[int, Ge(1)]
    grad_clip: Annotated[float, Gt(0.0)]
    clip_ratio_low: Annotated[float, Ge(0.0), Le(1.0)]
    clip_ratio_high: Annotated[float, Ge(0.0)]
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
    optim: OptimConfig


class FSDPConfig(TypedDict):
    param_dtype: Literal["float32", "bfloat16"]
    reduce_dtype: Literal["float32", "bfloat16"]


class TrainServiceTimeouts(TypedDict):
    zmq_recv_timeout_ms: Annotated[int, Ge(1)]
    zmq_total_timeout_ms: Annotated[int, Ge(1)]


class DeepSpeedConfig(TypedDict):
    zero_stage: Annotated[int, Ge(0), Le(3)]
    config: dict[str, Any]  # raw DeepSpeed keys, merged over the generated config


class TrainServiceConfig(TypedDict):
    backend: Literal["local", "noop", "direct-zmq"]  # noop: trains nothing (data-path benchmarks)
    url: str | None
    token_env: str
    model_tag: str
    identifier: str
    world_size: Annotated[int, Ge(1)]
    config: TrainServiceTimeouts
    connect_timeout_s: Annotated[float, Gt(0.0)]
    heartbeat_timeout_s: Annotated[float, Gt(0.0)]
    collective_timeout_s: Annotated[float, Gt(0.0)]
    idle_tick_s: Annotated[float, Gt(0.0)]
    engine: Literal["single", "fsdp", "deepspeed"]
    fsdp: FSDPConfig
    deepspeed: DeepSpeedConfig
    num_threads: Annotated[int, Ge(1)]
    device: Literal["cpu", "cuda"]
    dtype: Literal["float32", "bfloat16"]
    dist_backend: Literal["gloo", "nccl"]  # torch.distributed backend of the trainer group
    export_max_shard_mb: Annotated[int, Ge(1)]
    actor: ActorConfig


class LocalInferenceConfig(TypedDict):
    host: str
    port: Annotated[int, Ge(0), Le(65535)]
    max_batch_size: Annotated[int, Ge(1)]
    batch_wait_ms: Annotated[float, Ge(0.0)]
    num_threads: Annotated[int, Ge(1)]
    startup_timeout_s: Annotated[float, Gt(0.0)]
    startup_poll_s: Annotated[float, Gt(0.0)]  # ready file / /health polls during start-up
    stop_timeout_s: Annotated[float, Gt(0.0)]  # SIGTERM, then SIGKILL after this long
    engine_stop_timeout_s: Annotated[float, Gt(0.0)]  # the server's shutdown waits this long for its engine
    seed: int


class VLLMInferenceConfig(TypedDict):
    python: str  # the vLLM venv's interpreter (bash scripts/install_vllm.sh)
    host: str
    port: Annotated[int, Ge(0), Le(65535)]  # 0: a free port
    startup_timeout_s: Annotated[float, Gt(0.0)]
    startup_poll_s: Annotated[float, Gt(0.0)]  # /v1/models polls during start-up
    stop_timeout_s: Annotated[float, Gt(0.0)]  # SIGTERM the process group, SIGKILL after this long
    stop_poll_s: Annotated[float, Gt(0.0)]  # how often stop looks whether the group is gone
    dtype: Literal["float32", "bfloat16", "float16", "auto"]
    max_model_len: Annotated[int, Ge(1)] | None  # null: the model's max_position_embeddings
    pause_mode: Literal["wait", "keep"]  # weight reload: finish in-flight requests first | keep them
    device: Literal["cpu", "cuda"]  # vLLM's platform (the server's VLLM_TARGET_DEVICE)
    gpu_memory_utilization: Annotated[float, Gt(0.0), Le(1.0)] | None  # cuda only; null: vLLM's default
    tensor_parallel_size: Annotated[int, Ge(1)]
    extra_args: list[str]  # appended to the api_server command line
    env: dict[str, Any]  # added to the server's environment (values as strings)


class InferenceServiceConfig(TypedDict):
    # fake: zero-latency stand-in (data-path benchmarks) | vllm: vLLM's OpenAI server, its own venv
    # | sglang: an SGLang server at base_url (native /generate, /update_weights_from_disk)
    backend: Literal["local", "fake", "vllm", "sglang"]
    model_tag: str
    model: str
    base_url: str | None
    api_key: str | None
    max_retries: Annotated[int, Ge(0)]
    retry_backoff_s: Annotated[float, Ge(0.0)]
    request_timeout_s: Annotated[float, Gt(0.0)]
    freeze_for_weight_sync: bool
    weight_sync_poll_s: Annotated[
        float, Gt(0.0)
    ]  # a request held during a weight reload asks again this often
    fake_latency_ms: Annotated[float, Ge(0.0)]  # backend=fake: each request takes this long
    coalesce_wait_ms: Annotated[float, Ge(0.0)]
    max_coalesce: Annotated[int, Ge(1)]
    local: LocalInferenceConfig
    vllm: VLLMInferenceConfig


class ServiceConfig(TypedDict):
    train_service: TrainServiceConfig
    inference_service: InferenceServiceConfig


class EvalConfig(TypedDict):
    type: Literal["default"]
    validate_freq: int


class ValidateConfig(TypedDict):
    validate_before_train: bool
    validate_at_end: bool
    data: DataConfig
    eval: EvalConfig


class ResumeConfig(TypedDict):
    mode: Literal["disable", "auto", "from_path"]
    resume_path: str | None


class WandbConfig(TypedDict):
    mode: Literal["online", "offline", "disabled"]
    project: str
    entity: str | None
    name: str


class LoggerConfig(TypedDict):
    backend: list[Literal["console", "wandb"]]
    wandb: WandbConfig
    dump_rollouts: bool


class ExceptionHandlingConfig(TypedDict):
    enabled: bool
    check_interval: Annotated[float, Gt(0.0)]
    policy: Literal["stop_on_error", "continue", "stop_on_critical"]


class HealthCheckConfig(TypedDict):
    enabled: bool
    check_interval: Annotated[float, Gt(0.0)]
    timeout: Annotated[float, Gt(0.0)]
    reply_poll_s: Annotated[
        float, Gt(0.0)
    ]  # a rank awaiting a heartbeat's reply checks this often for a stop


class RuntimeMonitorConfig(TypedDict):
    exception_handling: ExceptionHandlingConfig
    health_check: HealthCheckConfig
    stop_timeout_s: Annotated[float, Gt(0.0)]
    release_wait_s: Annotated[float, Gt(0.0)]  # mpi: rank 0 waits this long for the answers to "release"
    poll_interval_s: Annotated[float, Gt(0.0)]  # how often the controller loop looks at the modules


class RpcConfig(TypedDict):
    interface: str  # address the ranks' RPC sockets bind to: an IP, "hostname", or an interface (eth0, ib0)
    max_message_mb: Annotated[int, Ge(1)]
    server_threads: Annotated[int, Ge(1)]  # calls served at once per rank (long polls excepted)
    long_poll_threads_per_peer: Annotated[int, Ge(1)]  # threads for @long_poll calls, per other rank
    direct_sockets_per_peer: Annotated[
        int, Ge(0)
    ]  # caller-owned direct-lane connections for blocking @quick calls
    call_timeout_s: Annotated[float, Gt(0.0)]


class RuntimeConfig(TypedDict):
    rpc: RpcConfig
    bootstrap_timeout_s: Annotated[float, Gt(0.0)]
    bootstrap_kill_after_s: Annotated[float, Gt(0.0)]  # a rank stuck in C code is ended this long after
    mpi_env: dict[str, str | int | float | bool]  # set before MPI_Init on every rank (MPICH CVARs)
    gc_freeze_after_setup: bool  # move start-up objects out of the GC's reach (no long gen-2 pauses)
    gc_thresholds: list[Annotated[int, Ge(1)]]  # gc.set_threshold(gen0, gen1, gen2)


class GroupResources(TypedDict):
    cpus_per_rank: Annotated[int, Ge(1)]
    gpus_per_rank: Annotated[int, Ge(0)]


class PlacementConfig(TypedDict):
    mode: Literal["auto", "manual"]
    roles: dict  # manual: {role: {count: N, colocation_group: name | null}}; checked by runtime/placement.py
    resources: dict[str, GroupResources]  # per colocation group, for the Slurm launcher


class PreemptionConfig(TypedDict):
    signal: Literal["USR1", "USR2", "TERM", "INT"]
    save_before_end_s: Annotated[float, Ge(0.0)]
    requeue: bool


class LauncherConfig(TypedDict):
    name: Literal["local", "slurm"]
    wait: bool
    poll_s: Annotated[float, Gt(0.0)]
    job_name: str
    partition: str | None
    account: str | None
    qos: str | None
    time_min: Annotated[int, Ge(1)]
    signal_grace_s: Annotated[int, Ge(0)]
    rollout_ranks: Annotated[int, Ge(1)]
    setup: list[str]
    sbatch: dict[str, Any]
    nodes: Annotated[int, Ge(1)] | None  # a one-component job: --nodes (null: Slurm packs the tasks)
    gres: str | None  # a one-component job: --gres, e.g. "gpu:8" (sites that count GPUs as gres)
    gpus_per_node: Annotated[int, Ge(1)] | None  # a one-component job: --gpus-per-node
    cpus_per_gpu: (
        Annotated[int, Ge(1)] | None
    )  # a one-component job: --cpus-per-gpu instead of --cpus-per-task


class RLTrainConfig(TypedDict):
    launch_mode: Literal["local", "mpi"]
    project_name: str
    experiment_name: str
    run_dir: str
    seed: int
    task: TaskConfig
    model: ModelConfig
    data: DataConfig
    rollout_worker: RolloutWorkerConfig
    trajectory_pool: TrajectoryPoolConfig
    algorithm: AlgorithmConfig
    train_batch_pool: TrainBatchPoolConfig
    train_worker: TrainWorkerConfig
    weight: WeightConfig
    service: ServiceConfig
    validate: ValidateConfig
    resume: ResumeConfig
    logger: LoggerConfig
    runtime_monitor: RuntimeMonitorConfig
    runtime: RuntimeConfig
    preemption: PreemptionConfig
    placement: PlacementConfig
    launcher: LauncherConfig
