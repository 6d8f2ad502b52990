"""The trainer's config checks: attention with shared prompts, mini-batches, the backend and its
ranks, sequence parallelism, timeouts, and the DeepSpeed keys the engine owns."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from nexrl_hpc.config.validate import ConfigProblem, config_value, g_safe, rule_problems

TS = "service.train_service"


def shared_prompt_problems(cfg: Mapping) -> list[ConfigProblem]:
    g = lambda p: config_value(cfg, p)  # noqa: E731
    return rule_problems(
        lambda: (
            g(f"{TS}.actor.share_prompt") is not True or g("model.attn_implementation") != "flash_attention_2"
        ),
        f"{TS}.actor.share_prompt",
        "needs model.attn_implementation eager or sdpa: flash_attention_2 takes no custom attention mask",
    )


def sequence_parallel_problems(cfg: Mapping) -> list[ConfigProblem]:
    """``sequence_parallel_size`` > 1: groups of that many trainer ranks, FSDP2, no 4-D masks, and
    query heads that split over the group (K/V heads fewer than the group are replicated)."""
    g = lambda p: config_value(cfg, p)  # noqa: E731
    key = f"{TS}.sequence_parallel_size"
    size = g_safe(cfg, key)
    if not isinstance(size, int) or size <= 1:
        return []
    heads = _attention_heads(cfg)
    rules: list[tuple[Any, str, str]] = [
        (
            lambda: g(f"{TS}.world_size") % size == 0,
            key,
            f"{size} must divide service.train_service.world_size={g_safe(cfg, f'{TS}.world_size')} "
            "(each group of that many trainer ranks splits the same rows' sequences)",
        ),
        (
            lambda: g(f"{TS}.engine") == "fsdp",
            key,
            f"{size} needs service.train_service.engine=fsdp (not {g_safe(cfg, f'{TS}.engine')})",
        ),
        (
            lambda: g(f"{TS}.actor.share_prompt") is not True,
            key,
            f"{size} takes no custom 4-D attention mask: set service.train_service.actor.share_prompt "
            "to false or auto (auto never shares under sequence parallelism)",
        ),
        (
            lambda: heads is None or heads % size == 0,
            key,
            f"{size} must divide the model's {heads} attention heads (each rank attends with heads / size)",
        ),
    ]
    return [p for holds, path, message in rules for p in rule_problems(holds, path, message)]


def _attention_heads(cfg: Mapping) -> int | None:
    """The model's query heads: ``model.tiny``'s, or ``model.path``'s config.json (None when it does
    not load: ``model.path``'s own check says why)."""
    path = g_safe(cfg, "model.path")
    if path is None:
        heads = g_safe(cfg, "model.tiny.num_attention_heads")
        return heads if isinstance(heads, int) else None
    try:
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(str(path)).num_attention_heads)
    except Exception:  # model_path_problems reports a directory that does not load
        return None


def train_service_problems(cfg: Mapping) -> list[ConfigProblem]:
    """Mini-batches that divide the batch, one policy model, and a backend that can reach its ranks."""
    g = lambda p: config_value(cfg, p)  # noqa: E731
    rules: list[tuple[Any, str, str]] = [
        (
            lambda: g(f"{TS}.actor.ppo_mini_batch_size") <= g("trajectory_pool.batch_size"),
            f"{TS}.actor.ppo_mini_batch_size",
            "must not exceed trajectory_pool.batch_size",
        ),
        (
            lambda: g("trajectory_pool.batch_size") % g(f"{TS}.actor.ppo_mini_batch_size") == 0,
            f"{TS}.actor.ppo_mini_batch_size",
            "must divide trajectory_pool.batch_size",
        ),
        (
            lambda: g(f"{TS}.model_tag") == g("service.inference_service.model_tag"),
            "service.inference_service.model_tag",
            "must equal service.train_service.model_tag (one policy model)",
        ),
        (
            lambda: g(f"{TS}.backend") != "direct-zmq" or _token_problem(cfg) is None,
            f"{TS}.token_env",
            f"backend=direct-zmq: {_token_problem(cfg)}",
        ),
        (
            lambda: g(f"{TS}.backend") != "direct-zmq" or bool(g(f"{TS}.url")),
            f"{TS}.url",
            "backend=direct-zmq needs the API server's URL (python -m launch.train_service)",
        ),
        (
            lambda: g(f"{TS}.world_size") == 1 or g("launch_mode") == "mpi" or g(f"{TS}.backend") != "local",
            f"{TS}.world_size",
            "more than one trainer rank needs launch_mode=mpi (trainer ranks in the job) or backend=direct-zmq "
            "(a standalone service)",
        ),
        (
            lambda: g(f"{TS}.engine") != "single" or g(f"{TS}.world_size") == 1,
            f"{TS}.engine",
            "engine=single runs one process: use fsdp or deepspeed for world_size > 1",
        ),
        (
            lambda: g(f"{TS}.config.zmq_recv_timeout_ms") <= g(f"{TS}.config.zmq_total_timeout_ms"),
            f"{TS}.config.zmq_recv_timeout_ms",
            "must not exceed service.train_service.config.zmq_total_timeout_ms",
        ),
    ]
    return [p for holds, path, message in rules for p in rule_problems(holds, path, message)]


def _token_problem(cfg: Mapping) -> str | None:
    """Why the API server's bearer token (the variable ``token_env`` names) cannot be used, or None."""
    from nexrl_hpc.rpc.preauth import token_problem

    name = g_safe(cfg, f"{TS}.token_env")
    return token_problem(os.environ.get(str(name), ""), f"the environment variable {name!r}")


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


def deepspeed_problems(cfg: Mapping) -> list[ConfigProblem]:
    """engine=deepspeed: the package is importable, and the raw ``config`` does not set owned keys."""
    if g_safe(cfg, f"{TS}.engine") != "deepspeed":
        return []
    problems = []
    if importlib.util.find_spec("deepspeed") is None:
        problems.append(
            ConfigProblem(
                f"{TS}.engine",
                "engine=deepspeed needs the deepspeed package (DS_BUILD_OPS=0 pip install 'nexrl_hpc[deepspeed]')",
            )
        )
    raw = g_safe(cfg, f"{TS}.deepspeed.config")
    if isinstance(raw, Mapping):
        for key, owner in _DEEPSPEED_OWNED.items():
            node: Any = raw
            for part in key.split("."):
                node = node.get(part) if isinstance(node, Mapping) else None
            if node is not None:
                problems.append(ConfigProblem(f"{TS}.deepspeed.config.{key}", f"is set by {owner}"))
    return problems
