"""LoRA rank 16 vs full fine-tuning: trainer peak memory and step time, weight-sync bytes and seconds.

A Qwen2.5-0.5B-shaped model (Qwen2, hidden 896, 14 heads / 2 KV heads, intermediate 4864, vocab
151,936, tied; random weights, fp32, CPU; ``--layers`` of its 24). Each variant runs in a fresh
subprocess: the real ``PolicyTrainer`` (``service.train_service.actor.lora.rank`` 16 or 0, gradient
checkpointing on, AdamW) does ``--steps`` ``update_actor`` calls on one batch of ``--rows`` sequences
(``--prompt-tokens`` + ``--tokens``); then one weight sync: the trainer's export
(``export_weights``: the adapter in PEFT layout, or the whole HF model) and the local engine's load
of it (``HFEngine.load_weights_from_disk``: the adapter applied to its base, or the weights copied
in). Bytes are the export's files.

Peak memory is the process's peak resident set over the training steps (``VmHWM``, reset by writing
5 to /proc/self/clear_refs after the model is loaded; glibc mmaps every allocation of 64 KiB or more,
so freed memory leaves the RSS): weights, gradients, optimizer state, activations. Step time: the
median of the steps after the first (the first creates AdamW's state).

    python bench/lora.py                      # the full 24 layers
    python bench/lora.py --layers 2 --steps 2 # a cheap dry run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

QWEN = {"hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864}
VOCAB = 151_936


def build_model_dir(out: str, layers: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        num_hidden_layers=layers,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        torch_dtype="float32",
        **QWEN,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def batch(rows: int, prompt: int, response: int) -> dict[str, torch.Tensor]:
    from nexrl_hpc.algorithm.batching import pack_trajectories
    from nexrl_hpc.types import Batch

    g = torch.Generator().manual_seed(0)
    trajs = [
        {
            "prompt_ids": torch.randint(10, VOCAB, (prompt,), generator=g).tolist(),
            "response_ids": torch.randint(10, VOCAB, (response,), generator=g).tolist(),
            "behaviour_log_probs": [-12.0] * response,
        }
        for _ in range(rows)
    ]
    t = pack_trajectories(Batch.from_trajectories(trajs), pad_token_id=0)
    t["old_log_probs"] = t["behaviour_log_probs"].clone()
    t["advantages"] = torch.randn(rows, 1, generator=g) * t["response_mask"]
    return t


def measure(model_dir: str, rank: int, args: argparse.Namespace, work: str) -> dict[str, Any]:
    """One variant, in this process: training peak RSS and step time, then one sync."""
    from nexrl_hpc.inference.engine import HFEngine
    from nexrl_hpc.models.tiny import load_model
    from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
    from nexrl_hpc.trainer.worker import TrainWorker
    from tests.conftest import compose_config

    torch.set_num_threads(args.threads)
    cfg = compose_config(
        [
            f"model.path={model_dir}",
            "model.gradient_checkpointing=true",
            f"service.train_service.actor.lora.rank={rank}",
            "service.train_service.actor.ppo_micro_batch_size=64",
            "service.train_service.logprob_chunk_tokens=256",
        ]
    )
    eng = PolicyTrainer(model_dir)
    eng.initialize_worker(TrainWorker(cfg, eng).train_service_config())
    eng.init_model()
    trainable = sum(p.numel() for p in eng.model.parameters() if p.requires_grad)
    data = batch(args.rows, args.prompt_tokens, args.tokens)
    reset_peak()
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        eng.update_actor({"batch": dict(data)})
        seconds.append(time.perf_counter() - start)
    peak = peak_rss()
    # one weight sync: the trainer's export, the local engine's load of it
    engine = SimpleNamespace(
        model=load_model(model_dir).eval(), _model_lock=threading.Lock(), weight_version=0
    )
    path = os.path.join(work, f"version_rank{rank}")
    start = time.perf_counter()
    eng.export_weights(path)
    exported = time.perf_counter() - start
    HFEngine.load_weights_from_disk(engine, path, 1)  # type: ignore[arg-type]
    sync = time.perf_counter() - start
    size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    steady = seconds[1:] or seconds
    return {
        "rank": rank,
        "trainable": trainable,
        "peak_bytes": peak,
        "step_s": statistics.median(steady),
        "sync_bytes": size,
        "export_s": exported,
        "sync_s": sync,
    }


def run_variant(model_dir: str, rank: int, args: argparse.Namespace, work: str) -> dict[str, Any]:
    out = os.path.join(work, f"result_{rank}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model_dir, str(rank), out, *sys.argv[1:]]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", PYTHONPATH=ROOT)
    subprocess.run(cmd, check=True, env=env)
    with open(out) as f:
        return dict(json.load(f))


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lora-rank", type=int, default=16)
    return p.parse_args(argv)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        model_dir, rank, out = sys.argv[2], int(sys.argv[3]), sys.argv[4]
        args = parse(sys.argv[5:])
        result = measure(model_dir, rank, args, os.path.dirname(out))
        with open(out, "w") as f:
            json.dump(result, f)
        return
    args = parse(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as work:
        model_dir = os.path.join(work, "model")
        build_model_dir(model_dir, args.layers)
        full = run_variant(model_dir, 0, args, work)
        lora = run_variant(model_dir, args.lora_rank, args, work)
    print(
        f"Qwen2.5-0.5B shape, {args.layers} layers, fp32 CPU, {args.threads} threads; batch {args.rows} x "
        f"({args.prompt_tokens} + {args.tokens}) tokens, gradient checkpointing, {args.steps} steps"
    )
    print(
        f"{'variant':<14}{'trainable':>14}{'peak GB':>10}{'step s':>9}{'sync MB':>11}{'export s':>10}{'sync s':>9}"
    )
    for name, r in ((f"LoRA r{args.lora_rank}", lora), ("full", full)):
        print(
            f"{name:<14}{r['trainable']:>14,}{r['peak_bytes'] / 1e9:>10.2f}{r['step_s']:>9.2f}"
            f"{r['sync_bytes'] / 1e6:>11.2f}{r['export_s']:>10.3f}{r['sync_s']:>9.3f}"
        )
    print(f"step time LoRA / full: {lora['step_s'] / full['step_s']:.2f}x")
    print(f"sync seconds LoRA / full: {lora['sync_s'] / full['sync_s']:.3f}x")
    print(f"trainer peak memory LoRA / full: {lora['peak_bytes'] / full['peak_bytes']:.2f}x")
    print(f"sync bytes LoRA / full: {lora['sync_bytes'] / full['sync_bytes']:.3f}x")


if __name__ == "__main__":
    main()
