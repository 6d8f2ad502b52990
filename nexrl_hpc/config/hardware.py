"""Checks of the hardware keys (``configs/hardware/<cpu|gpu>.yaml``): combinations that cannot run.

Two kinds, called from two places. ``hardware_problems`` looks only at the config and holds
wherever it is checked (a laptop, a login node, a rank). ``local_device_problems`` asks this
machine whether it has CUDA, so it is only meaningful where the run will execute: preflight calls
it for ``launcher=local`` with ``launch_mode=local`` (one process, here). It is skipped on a Slurm
login node (``launcher=slurm``, Hydra's submitit launcher: the job runs on other nodes) and for
``launch_mode=mpi`` (a rank may rightly see no GPU, e.g. the driver; a trainer rank without one
fails at start-up naming ``service.train_service.device``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from nexrl_hpc.config.validate import ConfigProblem

TS = "service.train_service"
VLLM = "service.inference_service.vllm"
_BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "nccl"}


def _get(cfg: Mapping, path: str) -> Any:
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def hardware_problems(cfg: Mapping) -> list[ConfigProblem]:
    """Device, dtype, attention, process-group backend and vLLM settings that contradict each other."""
    problems: list[ConfigProblem] = []
    device, dtype, backend = (
        _get(cfg, f"{TS}.device"),
        _get(cfg, f"{TS}.dtype"),
        _get(cfg, f"{TS}.dist_backend"),
    )
    want = _BACKEND_FOR_DEVICE.get(device) if isinstance(device, str) else None
    if want is not None and backend is not None and backend != want:
        problems.append(
            ConfigProblem(
                f"{TS}.dist_backend",
                f"{backend} with {TS}.device={device}: the trainer group needs {want} "
                "(NCCL moves only CUDA tensors; FSDP2's collectives on CUDA need NCCL); "
                "hardware=cpu|gpu sets both",
            )
        )
    attn = _get(cfg, "model.attn_implementation")
    if attn == "flash_attention_2":
        if device != "cuda" or dtype != "bfloat16":
            problems.append(
                ConfigProblem(
                    "model.attn_implementation",
                    f"flash_attention_2 runs on CUDA in bf16, not {TS}.device={device} with "
                    f"{TS}.dtype={dtype}: use hardware=gpu, or sdpa / eager",
                )
            )
        elif importlib.util.find_spec("flash_attn") is None:
            problems.append(
                ConfigProblem(
                    "model.attn_implementation",
                    "flash_attention_2 needs the flash-attn package (pip install flash-attn "
                    "--no-build-isolation): install it, or use sdpa",
                )
            )
    problems += _vllm_problems(cfg)
    problems += _slurm_gpu_problems(cfg)
    return problems


def _vllm_problems(cfg: Mapping) -> list[ConfigProblem]:
    """Only for a vLLM server the run starts (with base_url the server is someone else's)."""
    if _get(cfg, "service.inference_service.backend") != "vllm" or _get(
        cfg, "service.inference_service.base_url"
    ):
        return []
    problems: list[ConfigProblem] = []
    device = _get(cfg, f"{VLLM}.device")
    if device == "cpu" and _get(cfg, f"{VLLM}.gpu_memory_utilization") is not None:
        problems.append(
            ConfigProblem(
                f"{VLLM}.gpu_memory_utilization",
                f"is for {VLLM}.device=cuda; vLLM's CPU platform sizes its KV cache by "
                f"{VLLM}.env.VLLM_CPU_KVCACHE_SPACE (GiB): set it to null",
            )
        )
    env = _get(cfg, f"{VLLM}.env")
    if isinstance(env, Mapping) and "VLLM_TARGET_DEVICE" in env:
        problems.append(
            ConfigProblem(f"{VLLM}.env.VLLM_TARGET_DEVICE", f"is set by {VLLM}.device: remove it from env")
        )
    return problems


def _slurm_gpu_problems(cfg: Mapping) -> list[ConfigProblem]:
    """launcher=slurm with the auto placement: ranks that compute on CUDA ask Slurm for GPUs
    (``--gpus-per-task``, which also binds each rank to its own), or they would start without any."""
    if _get(cfg, "launcher.name") != "slurm" or _get(cfg, "placement.mode") != "auto":
        return []
    if _get(cfg, "launcher.gres") or _get(cfg, "launcher.gpus_per_node"):
        return []  # GPUs asked per node; which rank uses which is the site's setup (docs/gpu.md)
    problems: list[ConfigProblem] = []
    res = _get(cfg, "placement.resources") or {}
    trainer_gpus = (res.get("trainer") or {}).get("gpus_per_rank", 0)
    rollout_gpus = (res.get("rollout") or {}).get("gpus_per_rank", 0)
    if _get(cfg, f"{TS}.device") == "cuda" and _get(cfg, f"{TS}.backend") == "local" and trainer_gpus < 1:
        problems.append(
            ConfigProblem(
                "placement.resources.trainer.gpus_per_rank",
                f"{trainer_gpus}, but {TS}.device=cuda: each trainer rank needs a GPU (e.g. 1)",
            )
        )
    inference = _get(cfg, "service.inference_service.backend")
    need, why = 0, ""
    if inference == "vllm" and not _get(cfg, "service.inference_service.base_url"):
        if _get(cfg, f"{VLLM}.device") == "cuda":
            need = _get(cfg, f"{VLLM}.tensor_parallel_size") or 1
            why = f"{VLLM}.device=cuda with tensor_parallel_size={need}"
    elif inference == "local" and _get(cfg, f"{TS}.device") == "cuda":
        need, why = 1, f"the local inference server runs on {TS}.device=cuda"
    if rollout_gpus < need:
        problems.append(
            ConfigProblem(
                "placement.resources.rollout.gpus_per_rank",
                f"{rollout_gpus}, but {why}: each rollout rank needs {need} GPU(s)",
            )
        )
    return problems


def local_device_problems(cfg: Mapping) -> list[ConfigProblem]:
    """CUDA asked for, none visible on this machine (only where the run executes: see the module)."""
    wants = []
    if _get(cfg, f"{TS}.device") == "cuda" and _get(cfg, f"{TS}.backend") == "local":
        wants.append(f"{TS}.device")
    if (
        _get(cfg, "service.inference_service.backend") == "vllm"
        and not _get(cfg, "service.inference_service.base_url")
        and _get(cfg, f"{VLLM}.device") == "cuda"
    ):
        wants.append(f"{VLLM}.device")
    if not wants:
        return []
    import torch  # only when CUDA is asked for: the check costs torch's import

    if torch.cuda.is_available():
        return []
    why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
    return [
        ConfigProblem(
            key,
            f"cuda, but {why} on this machine (hardware=gpu needs a GPU here; "
            "drop it to run on CPU, or submit with launcher=slurm_gpu)",
        )
        for key in wants
    ]
