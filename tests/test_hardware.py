"""hardware=cpu|gpu: one override sets every device key, and the code that builds the trainer, its
process group, FSDP2's precision and vLLM's command line reads them. No GPU here: the GPU side is
checked up to the point where CUDA would be touched; gradient checkpointing runs for real on CPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import yaml

from nexrl_hpc.assembly import validate_config
from nexrl_hpc.config.hardware import hardware_problems, local_device_problems
from nexrl_hpc.config.location import config_dir
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.inference.vllm_server import VLLMServer
from nexrl_hpc.launcher.preflight import preflight
from nexrl_hpc.launcher.slurm import check_slurm_job
from nexrl_hpc.trainer.parallel import mixed_precision_policy
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
from nexrl_hpc.trainer.worker import TrainWorker
from tests.conftest import compose_config, compose_raw
from tests.test_policy_trainer import make_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_KEYS = {
    "model.attn_implementation": ("eager", "sdpa"),
    "model.gradient_checkpointing": (False, True),
    "service.train_service.device": ("cpu", "cuda"),
    "service.train_service.dtype": ("float32", "bfloat16"),
    "service.train_service.dist_backend": ("gloo", "nccl"),
    "service.train_service.fsdp.param_dtype": ("float32", "bfloat16"),
    "service.train_service.fsdp.reduce_dtype": ("float32", "float32"),
    "service.inference_service.vllm.device": ("cpu", "cuda"),
    "service.inference_service.vllm.dtype": ("float32", "bfloat16"),  # follows the trainer's
    "service.inference_service.vllm.gpu_memory_utilization": (None, 0.85),
    "service.inference_service.vllm.tensor_parallel_size": (1, 1),
    "service.inference_service.vllm.extra_args": (["--enforce-eager"], []),
    "weight.broadcast_backend": ("gloo", "nccl"),
}


def _get(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = cfg[part]
    return cfg


def _leaves(node: Any, prefix: str = "") -> set[str]:
    if not isinstance(node, dict):
        return {prefix}
    return set().union(*(_leaves(v, f"{prefix}.{k}" if prefix else k) for k, v in node.items()))


def test_hardware_files_set_the_same_keys() -> None:
    """Switching is symmetric: whatever gpu.yaml sets, cpu.yaml sets back (and the table above lists)."""
    with open(os.path.join(ROOT, "configs/hardware/cpu.yaml")) as f:
        cpu = _leaves(yaml.safe_load(f))
    with open(os.path.join(ROOT, "configs/hardware/gpu.yaml")) as f:
        gpu = _leaves(yaml.safe_load(f))
    assert cpu == gpu
    assert cpu == set(GPU_KEYS) - {"service.inference_service.vllm.dtype"}


def test_one_override_sets_every_gpu_key() -> None:
    default, cpu, gpu = compose_config([]), compose_config(["hardware=cpu"]), compose_config(["hardware=gpu"])
    for key, (cpu_value, gpu_value) in GPU_KEYS.items():
        assert _get(default, key) == cpu_value, key
        assert _get(cpu, key) == cpu_value, key
        assert _get(gpu, key) == gpu_value, key
    # flash attention is one more override away; the command line still wins over the group
    fa = compose_raw(["hardware=gpu", "model.attn_implementation=flash_attention_2"])
    assert fa.model.attn_implementation == "flash_attention_2"


def test_trainer_config_carries_the_hardware_keys() -> None:
    """What every trainer rank gets (initialize_worker's payload) holds device, dtype, backend,
    attention, FSDP2 precision and gradient checkpointing from the composed config."""
    ts = TrainWorker(compose_config(["hardware=gpu"]), PolicyTrainer()).train_service_config()
    assert (ts["device"], ts["dtype"], ts["dist_backend"]) == ("cuda", "bfloat16", "nccl")
    assert (ts["attn_implementation"], ts["gradient_checkpointing"]) == ("sdpa", True)
    assert ts["fsdp"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


def test_fsdp_mixed_precision_policy_from_the_gpu_config() -> None:
    fsdp = compose_config(["hardware=gpu"])["service"]["train_service"]["fsdp"]
    mp = mixed_precision_policy(fsdp["param_dtype"], fsdp["reduce_dtype"])
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    fsdp = compose_config([])["service"]["train_service"]["fsdp"]
    mp = mixed_precision_policy(fsdp["param_dtype"], fsdp["reduce_dtype"])
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.float32, torch.float32)


def _vllm(overrides: list[str], tmp_path: Any) -> VLLMServer:
    cfg = compose_config(overrides)
    return VLLMServer("/models/qwen", cfg["service"]["inference_service"]["vllm"], str(tmp_path), "policy")


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_vllm_command_line_and_environment_on_gpu(tmp_path: Any) -> None:
    server = _vllm(["hardware=gpu", "service.inference_service.vllm.tensor_parallel_size=2"], tmp_path)
    cmd = server.command(8000)
    assert _flag(cmd, "--dtype") == "bfloat16"
    assert _flag(cmd, "--gpu-memory-utilization") == "0.85"
    assert _flag(cmd, "--tensor-parallel-size") == "2"
    assert "--enforce-eager" not in cmd  # CUDA graphs on
    env = server.environment({"PATH": "/bin", "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": "/x"}, "/guard")
    assert env["VLLM_TARGET_DEVICE"] == "cuda"  # the config's device wins over the caller's environment
    assert env["PATH"] == "/bin" and env["VLLM_API_KEY"] == server.api_key
    assert env["PYTHONPATH"] == "/guard:/x"  # the key-checking middleware first


def test_vllm_command_line_on_cpu_is_unchanged(tmp_path: Any) -> None:
    """The tested CPU path: no GPU flags, eager mode, vLLM's CPU platform."""
    server = _vllm([], tmp_path)
    cmd = server.command(8000)
    assert cmd[1:] == [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/qwen",
        "--served-model-name",
        "policy",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--dtype",
        "float32",
        "--generation-config",
        "vllm",
        "--logprobs-mode",
        "processed_logprobs",
        "--middleware",
        "nexrl_vllm_guard.RequireKey",
        "--enforce-eager",
    ]
    assert server.environment({}, "/guard")["VLLM_TARGET_DEVICE"] == "cpu"


def _problems(overrides: list[str]) -> dict[str, str]:
    try:
        validate_config(compose_raw(overrides))
    except ConfigError as err:
        return {p.path: p.message for p in err.problems}
    return {}


def test_contradicting_hardware_keys_are_refused() -> None:
    assert (
        _problems(["hardware=gpu"]) == {}
    )  # cuda + bf16 + nccl + sdpa: fine (no CUDA asked of this machine)
    got = _problems(["hardware=gpu", "service.train_service.dist_backend=gloo"])
    assert "nccl" in got["service.train_service.dist_backend"]
    got = _problems(["service.train_service.dist_backend=nccl"])
    assert "gloo" in got["service.train_service.dist_backend"]
    got = _problems(["model.attn_implementation=flash_attention_2"])
    assert "CUDA in bf16" in got["model.attn_implementation"]
    got = _problems(
        ["hardware=gpu", "service.train_service.dtype=float32", "model.attn_implementation=flash_attention_2"]
    )
    assert "bf16" in got["model.attn_implementation"]
    if importlib.util.find_spec("flash_attn") is None:  # as on the project's machines
        got = _problems(["hardware=gpu", "model.attn_implementation=flash_attention_2"])
        assert "pip install flash-attn" in got["model.attn_implementation"]
    got = _problems(
        [
            "service.inference_service.backend=vllm",
            "service.inference_service.vllm.gpu_memory_utilization=0.5",
        ]
    )
    assert "VLLM_CPU_KVCACHE_SPACE" in got["service.inference_service.vllm.gpu_memory_utilization"]
    got = _problems(
        [
            "service.inference_service.backend=vllm",
            "+service.inference_service.vllm.env.VLLM_TARGET_DEVICE=cuda",
        ]
    )
    assert "vllm.device" in got["service.inference_service.vllm.env.VLLM_TARGET_DEVICE"]
    got = _problems(["hardware=gpu", "service.inference_service.vllm.gpu_memory_utilization=1.5"])
    assert "service.inference_service.vllm.gpu_memory_utilization" in got


def test_slurm_gpu_ranks_must_ask_for_gpus() -> None:
    """On the login node only the config is checked (its own CUDA is irrelevant): GPU ranks need GPUs."""
    gpu_slurm = [
        "hardware=gpu",
        "launcher=slurm_gpu",
        "launch_mode=mpi",
        "service.train_service.world_size=4",
        "service.train_service.engine=fsdp",
        "service.inference_service.backend=vllm",
    ]
    assert _problems(gpu_slurm) == {}
    got = _problems(["hardware=gpu", "launcher=slurm", "launch_mode=mpi"])
    assert set(got) == {
        "placement.resources.trainer.gpus_per_rank",
        "placement.resources.rollout.gpus_per_rank",
    }
    got = _problems([*gpu_slurm, "service.inference_service.vllm.tensor_parallel_size=2"])
    assert "tensor_parallel_size=2" in got["placement.resources.rollout.gpus_per_rank"]
    # a driver without a GPU makes a heterogeneous job: job-level sizing keys cannot apply
    cfg = compose_config(
        [*gpu_slurm, "placement.resources.driver.gpus_per_rank=0", "runtime.rpc.interface=ib0"]
    )
    problems = {p.path: p.message for p in check_slurm_job(cfg)}
    assert set(problems) == {"launcher.nodes"} and "heterogeneous" in problems["launcher.nodes"]


def test_local_gpu_run_without_cuda_fails_at_preflight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, on any machine
    got = {p.path: p.message for p in local_device_problems(compose_config(["hardware=gpu"]))}
    assert (
        set(got) == {"service.train_service.device"} and "hardware=gpu" in got["service.train_service.device"]
    )
    got = {
        p.path
        for p in local_device_problems(
            compose_config(["hardware=gpu", "service.inference_service.backend=vllm"])
        )
    }
    assert got == {"service.train_service.device", "service.inference_service.vllm.device"}
    assert local_device_problems(compose_config([])) == []
    with pytest.raises(ConfigError) as err:
        preflight(config_dir(), "rl_train", ["hardware=gpu"])
    assert err.value.exit_code == 2
    # launcher=slurm: the job runs elsewhere; this machine's CUDA is not asked (sinfo is, later)
    assert hardware_problems(compose_config(["hardware=gpu", "launcher=slurm_gpu", "launch_mode=mpi"])) == []


def test_launch_train_with_hardware_gpu_exits_2_naming_the_key(tmp_path: Any) -> None:
    start = time.monotonic()
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")  # no GPU visible, on any machine
    proc = subprocess.run(
        [sys.executable, "-m", "launch.train", "hardware=gpu", f"run_dir={tmp_path}/run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "service.train_service.device: cuda, but" in proc.stderr
    assert not os.path.exists(f"{tmp_path}/run")  # nothing started
    assert time.monotonic() - start < 60


def _trained(model_dir: str, checkpointing: bool) -> tuple[PolicyTrainer, dict[str, float], int]:
    cfg = compose_config(
        [
            f"model.gradient_checkpointing={str(checkpointing).lower()}",
            "service.train_service.actor.ppo_micro_batch_size=4",
        ]
    )
    eng = PolicyTrainer(model_dir)
    eng.initialize_worker(TrainWorker(cfg, eng).train_service_config())
    eng.init_model()
    # calls of the first layer's MLP: recomputation in backward shows as extra calls (module hooks
    # do not fire during torch's recompute, so the method is wrapped)
    calls = []
    mlp = eng.model.model.layers[0].mlp
    forward = mlp.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return forward(*args, **kwargs)

    mlp.forward = counted
    torch.manual_seed(0)
    metrics = eng.update_actor({"batch": make_batch(16)})["meta_info"]["metrics"]
    return eng, metrics, len(calls)


def _checkpointing(model: Any) -> bool:
    flag = getattr(model, "is_activation_checkpointing", None)  # transformers 5; 4.x: the old name
    return bool(model.is_gradient_checkpointing if flag is None else flag)


def test_gradient_checkpointing_trains_the_same_on_cpu(tiny_model_dir: str) -> None:
    """A real PPO step (4 micro-batches) with activations recomputed in backward: same loss, same
    gradient norm, same updated weights as without."""
    plain, m_plain, forwards_plain = _trained(tiny_model_dir, False)
    ckpt, m_ckpt, forwards_ckpt = _trained(tiny_model_dir, True)
    assert _checkpointing(ckpt.model) and not _checkpointing(plain.model)
    assert forwards_plain == 4 and forwards_ckpt == 8  # 4 micro-batches, each recomputed once
    assert m_ckpt["actor/pg_loss"] == pytest.approx(m_plain["actor/pg_loss"], abs=1e-7)
    assert m_ckpt["actor/grad_norm"] == pytest.approx(m_plain["actor/grad_norm"], rel=1e-6)
    assert m_plain["actor/grad_norm"] > 0
    after = dict(plain.model.named_parameters())
    for name, p in ckpt.model.named_parameters():
        assert torch.allclose(p, after[name], atol=1e-7, rtol=1e-6), name


def test_trainer_on_cuda_without_a_gpu_names_the_key(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, on any machine
    eng = PolicyTrainer(tiny_model_dir)
    eng.initialize_worker(TrainWorker(compose_config(["hardware=gpu"]), eng).train_service_config())
    with pytest.raises(RuntimeError, match="service.train_service.device=cuda"):
        eng.init_model()
