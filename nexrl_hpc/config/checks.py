"""Cross-field checks of a config that already has the right shape (each problem names its key)."""

from __future__ import annotations

import importlib.util
import inspect
import os
from collections.abc import Mapping
from typing import Any

from nexrl_hpc.config.algorithm_checks import algorithm_problems
from nexrl_hpc.config.hardware import hardware_problems
from nexrl_hpc.config.validate import ConfigError, ConfigProblem, config_value, g_safe, import_configured
from nexrl_hpc.runtime.placement import placement_problems
from nexrl_hpc.runtime.run_files import umask_problem


def _check_callable(
    cfg: Mapping,
    path: str,
    n_args: int | None,
    problems: list[ConfigProblem],
    kwargs: Mapping[str, Any] | None = None,
) -> None:
    try:
        spec = config_value(cfg, path)
    except KeyError:
        return
    if spec is None or not isinstance(spec, str):
        return
    try:
        obj = import_configured(spec, path)
    except ConfigError as exc:
        problems += exc.problems
        return
    if not callable(obj):
        problems.append(ConfigProblem(path, f"{spec!r} is not callable"))
        return
    if n_args is None:
        return
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*([None] * n_args), **dict(kwargs or {}))
    except TypeError:
        extra = f" and the keywords {sorted(kwargs)}" if kwargs else ""
        problems.append(
            ConfigProblem(
                path,
                f"{spec!r} must accept {n_args} positional arguments{extra}, its signature is "
                f"{spec.split(':')[-1]}{sig}",
            )
        )


def semantic_problems(cfg: Mapping) -> list[ConfigProblem]:
    """Problems that the schema cannot express; every check tolerates missing/mistyped keys."""
    problems: list[ConfigProblem] = []
    try:
        problems += placement_problems(cfg)
    except (KeyError, TypeError, AttributeError):
        pass  # the schema check reports the shape problem

    def check(cond_fn: Any, path: str, message: str) -> None:
        try:
            if not cond_fn():
                problems.append(ConfigProblem(path, message))
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            pass  # the schema check reports the underlying problem

    g = lambda p: config_value(cfg, p)  # noqa: E731

    from nexrl_hpc.rewards.loader import reward_problems  # imports config.validate: not at module level

    problems += reward_problems(cfg, "rollout_worker.reward_fn")
    if g_safe(cfg, "task.reward_fn") != g_safe(cfg, "rollout_worker.reward_fn"):
        problems += reward_problems(cfg, "task.reward_fn")
    if g_safe(cfg, "data.type") == "reasoning_gym":  # both splits are generated (data.prepare)
        from nexrl_hpc.tasks.reasoning_gym import reasoning_gym_problems  # only when configured

        for key in ("data.reasoning_gym", "validate.data.reasoning_gym"):
            problems += [ConfigProblem(*p) for p in reasoning_gym_problems(g_safe(cfg, key), key)]
    if g_safe(cfg, "model.path") is None:
        warmup_args = g_safe(cfg, "model.tiny.warmup_args")
        kwargs = warmup_args if isinstance(warmup_args, Mapping) else None
        _check_callable(cfg, "model.tiny.warmup", 3, problems, kwargs)
        if g_safe(cfg, "model.tiny.tokenizer.kind") == "chatml_bpe":
            if not g_safe(cfg, "model.tiny.tokenizer.corpus"):
                problems.append(
                    ConfigProblem(
                        "model.tiny.tokenizer.corpus",
                        "kind=chatml_bpe trains its BPE on a corpus: set 'module:function' returning texts",
                    )
                )
            corpus_args = g_safe(cfg, "model.tiny.tokenizer.corpus_args")
            kwargs = corpus_args if isinstance(corpus_args, Mapping) else None
            _check_callable(cfg, "model.tiny.tokenizer.corpus", 0, problems, kwargs)
    if g_safe(cfg, "rollout_worker.type") == "agent" and isinstance(
        g_safe(cfg, "rollout_worker.agent"), Mapping
    ):
        from nexrl_hpc.rollout.agent import agent_config_problems  # agents: only when configured

        problems += agent_config_problems(cfg)
    if g_safe(cfg, "data.type") == "task" or g_safe(cfg, "validate.data.type") == "task":
        if g_safe(cfg, "task.generator") is None:
            problems.append(
                ConfigProblem("task.generator", "data.type=task needs a generator ('module:function')")
            )
        else:
            _check_callable(cfg, "task.generator", 2, problems)
    rule = g_safe(cfg, "trajectory_pool.check_batch_ready_function")
    if isinstance(rule, str) and ":" in rule:
        _check_callable(cfg, "trajectory_pool.check_batch_ready_function", None, problems)
    elif isinstance(rule, str) and rule not in ("batch_size", "loaded_batch_finished"):
        problems.append(
            ConfigProblem(
                "trajectory_pool.check_batch_ready_function",
                f"{rule!r} is not 'batch_size', 'loaded_batch_finished' or a 'module:function' path",
            )
        )

    check(
        lambda: (
            g("service.train_service.actor.share_prompt") is not True
            or g("model.attn_implementation") != "flash_attention_2"
        ),
        "service.train_service.actor.share_prompt",
        "needs model.attn_implementation eager or sdpa: flash_attention_2 takes no custom attention mask",
    )
    check(
        lambda: len(g("runtime.gc_thresholds")) == 3,
        "runtime.gc_thresholds",
        "needs 3 values: gen0, gen1, gen2",
    )
    check(
        lambda: g("data.type") in ("task", "reasoning_gym") or len(g("data.data_files")) > 0,
        "data.data_files",
        f"data.type={g_safe(cfg, 'data.type')} needs at least one file",
    )
    check(
        lambda: (
            g("validate.data.type") in ("task", "reasoning_gym") or len(g("validate.data.data_files")) > 0
        ),
        "validate.data.data_files",
        f"validate.data.type={g_safe(cfg, 'validate.data.type')} needs at least one file",
    )
    check(
        lambda: g("resume.mode") != "from_path" or bool(g("resume.resume_path")),
        "resume.resume_path",
        "resume.mode=from_path needs resume.resume_path",
    )
    check(
        lambda: (
            not g("trajectory_pool.key_list")
            or g("trajectory_pool.batch_size") % g("trajectory_pool.group_size") == 0
        ),
        "trajectory_pool.batch_size",
        "must be a multiple of trajectory_pool.group_size so a batch never splits a group",
    )
    check(
        lambda: (
            not g("trajectory_pool.key_list") or g("trajectory_pool.group_size") == g("data.rollout_repeat_n")
        ),
        "trajectory_pool.group_size",
        "must equal data.rollout_repeat_n (the samples of one prompt form one group)",
    )
    check(
        lambda: g("service.train_service.actor.ppo_mini_batch_size") <= g("trajectory_pool.batch_size"),
        "service.train_service.actor.ppo_mini_batch_size",
        "must not exceed trajectory_pool.batch_size",
    )
    check(
        lambda: g("trajectory_pool.batch_size") % g("service.train_service.actor.ppo_mini_batch_size") == 0,
        "service.train_service.actor.ppo_mini_batch_size",
        "must divide trajectory_pool.batch_size",
    )
    check(
        lambda: g("service.train_service.model_tag") == g("service.inference_service.model_tag"),
        "service.inference_service.model_tag",
        "must equal service.train_service.model_tag (one policy model)",
    )
    check(
        lambda: (
            g("service.train_service.backend") != "direct-zmq"
            or bool(os.environ.get(g("service.train_service.token_env")))
        ),
        "service.train_service.token_env",
        f"backend=direct-zmq reads the API server's bearer token from the environment variable "
        f"{g_safe(cfg, 'service.train_service.token_env')!r}, which is not set",
    )
    check(
        lambda: g("service.train_service.backend") != "direct-zmq" or bool(g("service.train_service.url")),
        "service.train_service.url",
        "backend=direct-zmq needs the API server's URL (python -m launch.train_service)",
    )
    check(
        lambda: (
            g("service.train_service.world_size") == 1
            or g("launch_mode") == "mpi"
            or g("service.train_service.backend") != "local"
        ),
        "service.train_service.world_size",
        "more than one trainer rank needs launch_mode=mpi (trainer ranks in the job) or backend=direct-zmq "
        "(a standalone service)",
    )
    check(
        lambda: g("service.train_service.engine") != "single" or g("service.train_service.world_size") == 1,
        "service.train_service.engine",
        "engine=single runs one process: use fsdp or deepspeed for world_size > 1",
    )
    check(
        lambda: (
            g("service.train_service.config.zmq_recv_timeout_ms")
            <= g("service.train_service.config.zmq_total_timeout_ms")
        ),
        "service.train_service.config.zmq_recv_timeout_ms",
        "must not exceed service.train_service.config.zmq_total_timeout_ms",
    )
    if (umask := umask_problem(g_safe(cfg, "runtime.umask"))) is not None:
        problems.append(ConfigProblem("runtime.umask", umask))
    check(
        lambda: (
            g("service.inference_service.backend") != "local"
            or g("service.inference_service.max_coalesce")
            <= g("service.inference_service.local.max_prompts_per_request")
        ),
        "service.inference_service.local.max_prompts_per_request",
        "the local server would refuse the run's own coalesced requests: it must be >= "
        f"service.inference_service.max_coalesce ({g_safe(cfg, 'service.inference_service.max_coalesce')})",
    )
    problems += algorithm_problems(cfg)
    problems += bind_address_problems(cfg)
    problems += _deepspeed_problems(cfg)
    problems += hardware_problems(cfg)
    problems += _inference_backend_problems(cfg)
    problems += input_path_problems(cfg)
    if g_safe(cfg, "model.path") is None:
        check(
            lambda: g("model.tiny.hidden_size") % g("model.tiny.num_attention_heads") == 0,
            "model.tiny.num_attention_heads",
            "must divide model.tiny.hidden_size",
        )
        check(
            lambda: g("model.tiny.num_attention_heads") % g("model.tiny.num_key_value_heads") == 0,
            "model.tiny.num_key_value_heads",
            "must divide model.tiny.num_attention_heads",
        )
        check(
            lambda: (
                g("rollout_worker.max_prompt_length") + g("rollout_worker.max_response_length")
                <= g("model.tiny.max_position_embeddings")
            ),
            "rollout_worker.max_response_length",
            "max_prompt_length + max_response_length must fit model.tiny.max_position_embeddings",
        )
        check(
            lambda: g("model.tiny.tokenizer.kind") != "char" or len(g("model.tiny.tokenizer.alphabet")) > 0,
            "model.tiny.tokenizer.alphabet",
            "must not be empty",
        )
    return problems


def bind_address_problems(cfg: Mapping) -> list[ConfigProblem]:
    """The form of the bind-address settings (each rank resolves them on its own host at start)."""
    from nexrl_hpc.runtime.network import spec_problem  # imports config.validate: not at module level

    problems = []
    for key, unspecified_ok in (
        ("runtime.rpc.interface", False),  # exchanged with the other ranks: must be reachable
        ("service.inference_service.local.host", True),  # the rank's own server: 0.0.0.0 is a choice
        ("service.inference_service.vllm.host", True),
    ):
        value = g_safe(cfg, key)
        problem = spec_problem(value, allow_unspecified=unspecified_ok) if value is not None else None
        if problem:
            problems.append(ConfigProblem(key, problem))
    return problems


def _inference_backend_problems(cfg: Mapping) -> list[ConfigProblem]:
    """vllm: the venv exists (unless a server is given); sglang: only an already running server (base_url) is supported."""
    backend = g_safe(cfg, "service.inference_service.backend")
    base_url = g_safe(cfg, "service.inference_service.base_url")
    problems: list[ConfigProblem] = []
    if backend == "sglang" and not base_url:
        problems.append(
            ConfigProblem(
                "service.inference_service.base_url",
                "backend=sglang connects to a running SGLang server: set its URL (the run starts vLLM or "
                "the local server only)",
            )
        )
    if backend != "vllm":
        return problems
    python = g_safe(cfg, "service.inference_service.vllm.python")
    if not base_url and isinstance(python, str) and not os.access(python, os.X_OK):
        problems.append(
            ConfigProblem(
                "service.inference_service.vllm.python",
                f"{python!r} is not an executable: install vLLM's venv with `bash scripts/install_vllm.sh` "
                "(NEXRL_VLLM_VENV picks its location) or point this key at one",
            )
        )
    return problems


def input_path_problems(cfg: Mapping) -> list[ConfigProblem]:
    """The files the run reads at start-up exist: ``model.path`` (an HF-layout directory whose config
    and tokenizer load and that holds weights; null builds the tiny model) and the files of ``data.data_files`` and
    ``validate.data.data_files`` (read when data.type is jsonl, parquet or hf, or validate.data.type for
    the latter), whose first rows must have the configured keys (nexrl_hpc/data/checks.py). Checked
    here, on the login node before sbatch, instead of failing once the job runs. No weights are read."""
    problems: list[ConfigProblem] = []
    model_path = g_safe(cfg, "model.path")
    if isinstance(model_path, str):
        from nexrl_hpc.models.checks import model_dir_problem

        why = model_dir_problem(model_path)
        if why:
            problems.append(
                ConfigProblem(
                    "model.path",
                    f"{model_path!r}: {why} (expected an HF-layout model directory with config.json; "
                    "null builds the tiny model of model.tiny)",
                )
            )
    file_types = ("jsonl", "parquet", "hf")  # data.type values read from data_files
    train_files = g_safe(cfg, "data.type") in file_types
    for key, reads in (
        ("data.data_files", train_files),
        ("validate.data.data_files", train_files or g_safe(cfg, "validate.data.type") in file_types),
    ):
        files = g_safe(cfg, key)
        if not reads or not isinstance(files, list):
            continue
        prefix = key.rsplit(".", 1)[0]
        readable: list[tuple[int, str]] = []
        for i, path in enumerate(files):
            if not isinstance(path, str):
                continue  # the schema check reports the type
            why = _unreadable_file(path, allow_dir=g_safe(cfg, f"{prefix}.type") == "hf")
            if why:
                problems.append(ConfigProblem(f"{key}[{i}]", f"{path!r}: {why}"))
            else:
                readable.append((i, path))
        model_loads = not any(p.path == "model.path" for p in problems)  # the length check tokenizes
        if readable and model_loads:  # their first rows have the configured keys, some prompt fits
            from nexrl_hpc.data.checks import data_file_problems

            try:
                problems += data_file_problems(cfg, prefix, key, readable)
            except (KeyError, TypeError, AttributeError):
                pass  # the schema check reports the shape problem
    return problems


def _unreadable_file(path: str, allow_dir: bool = False) -> str:
    """Why ``path`` cannot be read as a data file ('' if it can); ``allow_dir``: a datasets.save_to_disk folder."""
    if not os.path.exists(path):
        return "no such file"
    if os.path.isdir(path):
        if allow_dir:
            return "" if os.access(path, os.R_OK | os.X_OK) else "cannot be read (permission denied)"
        return "is a directory, not a file"
    if not os.path.isfile(path):
        return "not a regular file"
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    return ""


# DeepSpeed keys the generated config owns (nexrl_hpc.trainer.deepspeed_strategy): a raw override
# of one would desynchronise DeepSpeed from the engine's own accumulation, clipping and dtype
_DEEPSPEED_OWNED = {
    "zero_optimization.stage": "service.train_service.deepspeed.zero_stage",
    "bf16": "service.train_service.dtype",
    "fp16": "service.train_service.dtype",
    "gradient_clipping": "service.train_service.actor.grad_clip",
    "optimizer": "service.train_service.actor.optim",
    "scheduler": "service.train_service.actor.optim",
    "train_batch_size": "the engine (it plans the micro-batches)",
    "train_micro_batch_size_per_gpu": "the engine (it plans the micro-batches)",
    "gradient_accumulation_steps": "the engine (it plans the micro-batches)",
    "managed_gradient_accumulation": "the engine (it calls step once per mini-batch)",
}


def _deepspeed_problems(cfg: Mapping) -> list[ConfigProblem]:
    """engine=deepspeed: the package is importable, and the raw ``config`` does not set owned keys."""
    if g_safe(cfg, "service.train_service.engine") != "deepspeed":
        return []
    problems = []
    if importlib.util.find_spec("deepspeed") is None:
        problems.append(
            ConfigProblem(
                "service.train_service.engine",
                "engine=deepspeed needs the deepspeed package (DS_BUILD_OPS=0 pip install 'nexrl_hpc[deepspeed]')",
            )
        )
    raw = g_safe(cfg, "service.train_service.deepspeed.config")
    if isinstance(raw, Mapping):
        for key, owner in _DEEPSPEED_OWNED.items():
            node: Any = raw
            for part in key.split("."):
                node = node.get(part) if isinstance(node, Mapping) else None
            if node is not None:
                problems.append(
                    ConfigProblem(f"service.train_service.deepspeed.config.{key}", f"is set by {owner}")
                )
    return problems
