"""The GPU check: one command for a machine with NVIDIA GPUs and no network.

It builds a model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads,
intermediate 4864, vocabulary 151,936, tied embeddings; random weights) and a byte-level BPE
tokenizer offline, then runs, each stage in its own processes with its own time limit (a failure is
reported with its traceback and the next stage still runs):

- ``local``: a few GRPO steps, ``hardware=gpu``, ``launch_mode=local``, the local engine server;
- ``mpi_fsdp``: the same under ``mpirun`` (``launch_mode=mpi``: driver, a trainer group of 1 rank on
  NCCL with FSDP2, a rollout rank);
- ``mpi_deepspeed``: the same with DeepSpeed ZeRO-3;
- ``local_lora``: ``local`` with a rank-16 LoRA adapter (peft), each sync shipping only the adapter;
- ``local_ppo``: ``local`` with ``algorithm=ppo``: a critic (a value head on a copy of the model) trained
  beside the actor, GAE advantages (its MFU counts the actor's FLOPs over both updates' time);
- ``memory``: ``bench/memory.py`` (log-prob/entropy memory, bounded vs materialised) on the GPU.

It prints, per stage: generation and training tokens/s, the trainer's MFU (model FLOPs of the
update / the card's peak dense bf16 FLOP/s, read from a table by the card's name or given by
``--peak-tflops``), the trainer's peak GPU memory (``perf/max_memory_allocated_gb``) and the GPU's
(nvidia-smi, sampled each second), and weight delivery: the median sync's seconds, the largest
canary disagreement engine vs trainer (``weight_sync/verify_max_abs_diff``) and the largest
``train/logprob_mismatch_max``. Model FLOPs per trained token: 6 N + 6 L h s (N the parameters, the
tied embedding once; L layers, h hidden size, s the mean trained sequence length: causal attention,
forward and backward); gradient checkpointing's recomputation is not counted.

Beyond a stock CUDA PyTorch image it needs only wheels it installs offline from ``--wheels DIR``
(``pip install --no-index --no-deps --target``); it prints which. ``--dry-run`` runs the same code
with ``hardware=cpu``, 2 layers of hidden size 128 (the full vocabulary) and short responses: the test
suite runs it (tests/test_gpu_check.py). ``--hardware cpu`` runs the full-size model on CPU, where
``--only local_vllm`` adds a stage with vLLM's CPU server (``scripts/install_vllm.sh``).

    python bench/gpu_check.py --wheels .whl --out /tmp/gpu_check      # on the GPU machine
    python bench/gpu_check.py --dry-run --out /tmp/gpu_check_dry        # anywhere
    python bench/gpu_check.py --hardware cpu --steps 1 --prompts 4 --samples 2 --only local local_vllm
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

QWEN25_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}
DRY_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
MODEL_VOCAB = 151_936
# dense bf16 tensor-core peaks (NVIDIA datasheets, no sparsity); the first name contained in the card's wins
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
]
TAIL_LINES = 60


@dataclass
class StageResult:
    name: str
    ok: bool = False
    seconds: float = 0.0
    detail: str = ""
    numbers: dict[str, float] = field(default_factory=dict)
    steps: list[dict[str, float]] = field(default_factory=list)  # each step's timing/* and perf/* metrics


def log(out_dir: str, text: str) -> None:
    print(text, flush=True)
    with open(os.path.join(out_dir, "gpu_check.log"), "a") as f:
        f.write(text + "\n")


def install_wheels(wheel_dir: str, site: str) -> tuple[list[str], dict[str, str]]:
    """Install every wheel of ``wheel_dir`` into ``site`` (offline); returns their names and the
    environment the stages need (PYTHONPATH, and for a carried MPICH its mpirun and libmpi)."""
    wheels = sorted(f for f in os.listdir(wheel_dir) if f.endswith(".whl"))
    if not wheels:
        return [], {}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--upgrade", "--target", site, *(os.path.join(wheel_dir, w) for w in wheels)]
    subprocess.run(cmd, check=True)
    env = {"PYTHONPATH": site}
    for wheel in wheels:  # pip --target keeps a wheel's scripts but drops its data/lib: MPICH's libmpi
        with zipfile.ZipFile(os.path.join(wheel_dir, wheel)) as z:
            for name in z.namelist():
                parts = name.split("/")
                if len(parts) > 3 and parts[0].endswith(".data") and parts[2] in ("lib", "bin"):
                    target = os.path.join(site, parts[2], *parts[3:])
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    if not name.endswith("/"):
                        with z.open(name) as src, open(target, "wb") as dst:
                            shutil.copyfileobj(src, dst)
                        os.chmod(target, 0o755)
    libmpi = os.path.join(site, "lib", "libmpi.so.12")
    if os.path.exists(libmpi):
        env["MPI4PY_LIBMPI"] = libmpi
        env["LD_LIBRARY_PATH"] = os.path.join(site, "lib")
    if os.path.isdir(os.path.join(site, "bin")):
        env["PATH"] = os.path.join(site, "bin")
    return [w.split("-")[0] + " " + w.split("-")[1] for w in wheels], env


def stage_env(base: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    for key, value in extra.items():
        env[key] = value + (os.pathsep + env[key] if env.get(key) else "")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def environment_report(env: dict[str, str]) -> str:
    """Torch, the GPUs, and the version of every package the stages import (or why it is missing)."""
    probe = r"""
import importlib, shutil, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
for name in ["transformers", "hydra", "omegaconf", "zmq", "openai", "fastapi", "uvicorn",
             "cryptography", "submitit", "deepspeed", "mpi4py", "safetensors", "h5py",
             "launch.train", "nexrl_hpc.inference.server", "nexrl_hpc.runtime.mpi"]:
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')} ({m.__file__})")
    except Exception as e:
        print(f"{name} MISSING: {type(e).__name__}: {e}")
print("mpirun", shutil.which("mpirun"))
"""
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    return done.stdout + done.stderr


def card_peak_tflops(env: dict[str, str]) -> tuple[str, float | None]:
    probe = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    name = done.stdout.strip() or "unknown"
    return name, next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def build_model(model_dir: str, shape: dict[str, int], env: dict[str, str]) -> dict[str, Any]:
    """The model directory (tokenizer trained offline on the task's own text) and its size."""
    script = f"""
import json, sys
from nexrl_hpc.models.chatml import build_qwen2_model, save_model_dir, train_chatml_tokenizer
from nexrl_hpc.tasks.max_digit import generate_splits
rows = generate_splits({{"num_digits": 3, "train_size": 2000, "val_per_answer": 1}}, seed=0)["train"]
texts = [r["prompt"] + str(r["answer"]) for r in rows] + ["the largest of three digits"] * 50
tok = train_chatml_tokenizer(texts, vocab_size=512)
model = build_qwen2_model(tok, max_position_embeddings=4096, model_vocab_size={MODEL_VOCAB}, **{shape!r})
save_model_dir(model, tok, {model_dir!r})
n = sum(p.numel() for p in model.parameters())
print(json.dumps({{"parameters": n, "tokenizer_ids": len(tok)}}))
"""
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    info = json.loads(done.stdout.strip().splitlines()[-1])
    info.update(layers=shape["num_hidden_layers"], hidden=shape["hidden_size"])
    return info


class MemorySampler:
    """The GPU's used memory (nvidia-smi, all processes) sampled each second while a stage runs."""

    def __init__(self) -> None:
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> MemorySampler:
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.wait(1.0):
            done = subprocess.run(query, capture_output=True, text=True)
            used = [float(v) for v in done.stdout.split() if v.replace(".", "").isdigit()]
            self.peak_mib = max([self.peak_mib, *used])

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def run_stage(name: str, cmd: list[str], env: dict[str, str], timeout: float, out_dir: str) -> StageResult:
    """Run one stage; its whole output goes to gpu_check.log, the tail of a failure to the console."""
    log(out_dir, f"\n=== {name}: {' '.join(cmd)}")
    result = StageResult(name)
    start = time.monotonic()
    with MemorySampler() as sampler:
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
            output, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            output += f"\nTIMED OUT after {timeout:.0f} s"
            code = -1
    result.seconds = time.monotonic() - start
    result.ok = code == 0
    if sampler.peak_mib:
        result.numbers["gpu_peak_gb"] = sampler.peak_mib / 1024
    with open(os.path.join(out_dir, "gpu_check.log"), "a") as f:
        f.write(output)
    if result.ok and name == "memory":  # the bench's own summary
        print("\n".join(output.splitlines()[-22:]), flush=True)
    if not result.ok:
        result.detail = f"exit {code}"
        tail = "\n".join(output.splitlines()[-TAIL_LINES:])
        print(f"--- {name} FAILED ({result.detail}); last {TAIL_LINES} lines:\n{tail}", flush=True)
    return result


def train_args(args: argparse.Namespace, model_dir: str, run_dir: str) -> list[str]:
    return [
        f"hardware={args.hardware}",
        "task=max_digit",  # its prompts and reward; the model is ours (model.path)
        f"model.path={model_dir}",
        f"run_dir={run_dir}",
        f"data.batch_size={args.prompts}",
        f"data.rollout_repeat_n={args.samples}",
        f"rollout_worker.max_response_length={args.response_length}",
        f"train_worker.total_train_steps={args.steps}",
        "train_worker.save_freq=0",
        "service.train_service.actor.optim.lr=1e-6",
        "validate.validate_before_train=false",
        "validate.validate_at_end=false",
        "validate.eval.validate_freq=0",
        "logger.backend=[]",
        # a 0.5B model generating 256 tokens on a few CPU cores takes minutes: no request timeout
        *(["service.inference_service.request_timeout_s=3600"] if args.hardware == "cpu" else []),
    ]


def read_rows(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(map(json.loads, f))


def sync_numbers(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Weight delivery over the run's rows: the median sync's seconds (``weight_sync/seconds``), the
    largest canary disagreement between engine and trainer (``weight.verify_every``) and the largest
    log-prob mismatch of the trained samples."""
    numbers: dict[str, float] = {}
    seconds = [r["weight_sync/seconds"] for r in rows if "weight_sync/seconds" in r]
    if seconds:
        numbers["sync_s"] = statistics.median(seconds)
    verified = [r["weight_sync/verify_max_abs_diff"] for r in rows if "weight_sync/verify_max_abs_diff" in r]
    if verified:
        numbers["verify_max_abs_diff"] = max(verified)
    mismatch = [
        r["train/logprob_mismatch_max"] for r in rows if r.get("train/logprob_mismatch_max") is not None
    ]
    if mismatch:
        numbers["logprob_mismatch_max"] = max(mismatch)
    return numbers


def run_numbers(
    steps: list[dict[str, Any]], model: dict[str, Any], peak_tflops: float | None
) -> dict[str, float]:
    """Throughput and MFU from the steps' metrics (the first step, which warms up, left out when
    there are more)."""
    if not steps:
        return {}
    steady = steps[1:] or steps
    gen = [
        s["perf/generated_tokens"] / s["timing/generation_s"] for s in steady if s["timing/generation_s"] > 0
    ]
    trained = [s["perf/trained_tokens"] / s["timing/update_s"] for s in steady if s["timing/update_s"] > 0]
    numbers = {"gen_tok_s": statistics.median(gen) if gen else 0.0}
    numbers["train_tok_s"] = statistics.median(trained) if trained else 0.0
    mean_len = statistics.mean(s["perf/trained_tokens"] / max(s["perf/trajectories"], 1.0) for s in steady)
    flops_per_token = 6 * model["parameters"] + 6 * model["layers"] * model["hidden"] * mean_len
    if peak_tflops:
        numbers["mfu"] = flops_per_token * numbers["train_tok_s"] / (peak_tflops * 1e12)
    last = steps[-1]
    for key in ("perf/max_memory_allocated_gb", "perf/max_rss_gb"):
        if key in last:
            numbers[key.split("/")[1]] = float(last[key])
    numbers["undecodable_tokens"] = float(last.get("rollout/undecodable_tokens", 0.0))
    return numbers


def vllm_python() -> str | None:
    """The vLLM venv's interpreter (``scripts/install_vllm.sh``), where one is installed."""
    venv = os.environ.get("NEXRL_VLLM_VENV", os.path.expanduser("~/.cache/nexrl_hpc/vllm-venv"))
    python = os.path.join(venv, "bin", "python")
    return python if os.path.exists(python) else None


def training_stages(args: argparse.Namespace, model_dir: str, work: str) -> list[tuple[str, list[str]]]:
    py = [sys.executable, "-m", "launch.train"]
    mpi = ["mpirun", "-n", "3", sys.executable, "-m", "launch.train", "launch_mode=mpi"]
    group = ["service.train_service.world_size=1"]
    stages = [("local", [*py, *train_args(args, model_dir, os.path.join(work, "local"))])]
    if vllm_python() is not None:  # never on the GPU machine (vLLM cannot be carried): only by --only
        vllm = [*py, *train_args(args, model_dir, os.path.join(work, "local_vllm"))]
        stages.append(("local_vllm", [*vllm, "service.inference_service.backend=vllm"]))
    lora = [*py, *train_args(args, model_dir, os.path.join(work, "local_lora"))]
    ppo = [*py, *train_args(args, model_dir, os.path.join(work, "local_ppo"))]
    return stages + [
        (
            "mpi_fsdp",
            [*mpi, *train_args(args, model_dir, os.path.join(work, "mpi_fsdp")), *group]
            + ["service.train_service.engine=fsdp"],
        ),
        (
            "mpi_deepspeed",
            [*mpi, *train_args(args, model_dir, os.path.join(work, "mpi_deepspeed")), *group]
            + ["service.train_service.engine=deepspeed"],
        ),
        ("local_lora", [*lora, "service.train_service.actor.lora.rank=16"]),
        ("local_ppo", [*ppo, "algorithm=ppo", "service.train_service.critic.warmup_steps=0"]),
    ]


def memory_stage(args: argparse.Namespace) -> list[str] | None:
    script = os.path.join(REPO, "bench", "memory.py")
    if not os.path.exists(script):
        return None
    if args.dry_run:
        return [sys.executable, script, "--device", "cpu", "--layers", "2", "--tokens", "256"]
    if args.hardware == "cpu":
        return [sys.executable, script, "--device", "cpu"]
    return [sys.executable, script, "--device", "cuda", "--dtype", "bfloat16"]


def fmt(numbers: dict[str, float], key: str, spec: str) -> str:
    return format(numbers[key], spec) if key in numbers else "-"


def report(results: list[StageResult], out_dir: str, card: str, peak: float | None) -> None:
    lines = [
        f"card: {card}; peak dense bf16: {f'{peak:.0f} TFLOP/s' if peak else 'unknown (--peak-tflops)'}",
        "| stage | result | wall s | gen tok/s | train tok/s | MFU | trainer peak GB | GPU peak GB "
        "| sync s | verify max abs delta | mismatch max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        n = r.numbers
        trainer = fmt(n, "max_memory_allocated_gb", ".2f")
        if trainer == "-" and "max_rss_gb" in n:
            trainer = f"{n['max_rss_gb']:.2f} (RSS)"
        lines.append(
            f"| {r.name} | {'ok' if r.ok else 'FAILED ' + r.detail} | {r.seconds:.0f} "
            f"| {fmt(n, 'gen_tok_s', '.0f')} | {fmt(n, 'train_tok_s', '.0f')} "
            f"| {fmt(n, 'mfu', '.1%')} | {trainer} | {fmt(n, 'gpu_peak_gb', '.1f')} "
            f"| {fmt(n, 'sync_s', '.2f')} | {fmt(n, 'verify_max_abs_diff', '.1e')} "
            f"| {fmt(n, 'logprob_mismatch_max', '.1e')} |"
        )
    log(out_dir, "\n".join(lines))
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump([r.__dict__ for r in results], f, indent=1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="hardware=cpu, a 2-layer model: the CI path")
    p.add_argument("--hardware", choices=["gpu", "cpu"], default=None, help="gpu; dry run cpu")
    p.add_argument("--wheels", default=None, help="a folder of wheels to install offline first")
    p.add_argument("--out", default=None, help="gpu_check.log and results.json go here")
    p.add_argument("--work", default=None, help="model and run dirs (default: a temporary folder)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per stage (3; dry run 1)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--response-length", type=int, default=None, help="256; dry run 8")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (24; dry run 2)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's dense bf16 peak")
    p.add_argument("--stage-timeout", type=float, default=240.0, help="seconds per stage")
    p.add_argument("--only", nargs="*", default=None, help="run only these stages, in this order")
    args = p.parse_args(argv)
    args.hardware = args.hardware or ("cpu" if args.dry_run else "gpu")
    args.steps = args.steps or (1 if args.dry_run else 3)
    args.response_length = args.response_length or (8 if args.dry_run else 256)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = args.out or tempfile.mkdtemp(prefix="gpu_check_")
    work = args.work or tempfile.mkdtemp(prefix="gpu_check_work_")
    os.makedirs(out_dir, exist_ok=True)
    extra: dict[str, str] = {}
    if args.wheels:
        names, extra = install_wheels(args.wheels, os.path.join(work, "site"))
        log(out_dir, f"installed offline from {args.wheels}: {', '.join(names) or 'none'}")
    else:
        log(out_dir, "no wheels installed (--wheels not given)")
    env = stage_env(dict(os.environ), extra)
    log(out_dir, environment_report(env))
    card, table_peak = card_peak_tflops(env)
    peak = args.peak_tflops or (None if args.hardware == "cpu" else table_peak)
    shape = dict(DRY_SHAPE if args.dry_run else QWEN25_05B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    model_dir = os.path.join(work, "model")
    start = time.monotonic()
    model = build_model(model_dir, shape, env)
    log(out_dir, f"model: {model} built in {time.monotonic() - start:.0f} s at {model_dir}")
    stages = dict(training_stages(args, model_dir, work))
    memory = memory_stage(args)
    if memory is not None:
        stages["memory"] = memory
    default = [name for name in stages if name != "local_vllm"]  # vLLM's stage only when asked
    results: list[StageResult] = []
    for name in args.only or default:  # --only's order: the most wanted first
        if name not in stages:
            log(out_dir, f"\n=== {name}: not available (stages: {', '.join(stages)})")
            results.append(StageResult(name, detail="not available"))
            continue
        result = run_stage(name, stages[name], env, args.stage_timeout, out_dir)
        rows = read_rows(os.path.join(work, name))
        steps = [row for row in rows if "timing/update_s" in row]
        result.numbers.update(run_numbers(steps, model, peak))
        result.numbers.update(sync_numbers(rows))
        result.steps = [{k: v for k, v in s.items() if k.startswith(("timing/", "perf/"))} for s in steps]
        results.append(result)
    report(results, out_dir, card, peak)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
