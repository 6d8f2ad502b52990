"""The inference service's config checks: the local server accepts the run's coalesced requests;
vLLM's venv exists (unless a server is given); SGLang only as an already running server."""

from __future__ import annotations

import os
from collections.abc import Mapping

from nexrl_hpc.config.validate import ConfigProblem, config_value, g_safe, rule_problems

INF = "service.inference_service"


def coalesce_problems(cfg: Mapping) -> list[ConfigProblem]:
    g = lambda p: config_value(cfg, p)  # noqa: E731
    return rule_problems(
        lambda: (
            g(f"{INF}.backend") != "local"
            or g(f"{INF}.max_coalesce") <= g(f"{INF}.local.max_prompts_per_request")
        ),
        f"{INF}.local.max_prompts_per_request",
        "the local server would refuse the run's own coalesced requests: it must be >= "
        f"service.inference_service.max_coalesce ({g_safe(cfg, f'{INF}.max_coalesce')})",
    )


def inference_backend_problems(cfg: Mapping) -> list[ConfigProblem]:
    """vllm: the venv exists (unless a server is given); sglang: only an already running server (base_url) is supported."""
    backend = g_safe(cfg, f"{INF}.backend")
    base_url = g_safe(cfg, f"{INF}.base_url")
    problems: list[ConfigProblem] = []
    if backend == "sglang" and not base_url:
        problems.append(
            ConfigProblem(
                f"{INF}.base_url",
                "backend=sglang connects to a running SGLang server: set its URL (the run starts vLLM or "
                "the local server only)",
            )
        )
    if backend != "vllm":
        return problems
    python = g_safe(cfg, f"{INF}.vllm.python")
    if not base_url and isinstance(python, str) and not os.access(python, os.X_OK):
        problems.append(
            ConfigProblem(
                f"{INF}.vllm.python",
                f"{python!r} is not an executable: install vLLM's venv with `bash scripts/install_vllm.sh` "
                "(NEXRL_VLLM_VENV picks its location) or point this key at one",
            )
        )
    return problems


def weight_broadcast_problems(cfg: Mapping) -> list[ConfigProblem]:
    """weight.broadcast_backend=nccl sends from the trainer's GPU: it needs a CUDA trainer."""
    device = g_safe(cfg, "service.train_service.device")
    return rule_problems(
        lambda: (
            g_safe(cfg, "weight.transport") != "broadcast"
            or g_safe(cfg, "weight.broadcast_backend") != "nccl"
            or device == "cuda"
        ),
        "weight.broadcast_backend",
        f"nccl broadcasts between GPUs, and the trainer runs on {device!r}: use gloo (or hardware=gpu)",
    )
