"""Trainer-vs-engine log-prob mismatch at the sampling temperature, with and without top-p.

Each configuration is a short run of the default task (``python -m launch.train``, the old
log-probs recomputed by the trainer) with its first batch dumped; the table shows, per
configuration, the run's ``train/logprob_mismatch_max`` / ``_mean`` over its steps (trainer vs the
engine's reported log-probs), the first batch's engine log-probs against log_softmax(logits / T) of
the model that sampled them, and -log(top_p), the bound of the truncation's gap. The baseline is
temperature 1 without truncation, measured in the same run of this bench.

    python bench/logprob_temperature.py [--backend local|vllm] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nexrl_hpc.models.tiny import load_model  # noqa: E402

CONFIGS = [(1.0, 1.0), (0.7, 1.0), (0.7, 0.9), (0.7, 0.5)]  # (temperature, top_p); the first: baseline


def behaviour_gap(run_dir: Path, temperature: float) -> float:
    """max |engine log-prob - log_softmax(base logits / T)| over step 1's tokens (sampled by version 0)."""
    import h5py

    with h5py.File(run_dir / "rollouts" / "step_1.h5") as f:
        ids = torch.from_numpy(f["input_ids"][:]).long()
        attention = torch.from_numpy(f["attention_mask"][:]).long()
        responses = torch.from_numpy(f["responses"][:]).long()
        mask = torch.from_numpy(f["response_mask"][:]).float()
        behaviour = torch.from_numpy(f["behaviour_log_probs"][:]).float()
    model = load_model(str(run_dir / "base_model")).eval()
    r = responses.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0)
        ).logits[:, -r - 1 : -1, :]
    log_p = torch.log_softmax(logits.float() / temperature, -1).gather(-1, responses[..., None]).squeeze(-1)
    return float(((log_p - behaviour) * mask).abs().max())


def run(temperature: float, top_p: float, backend: str, steps: int, root: str) -> dict[str, float]:
    run_dir = Path(root) / f"t{temperature}_p{top_p}"
    args = [
        f"run_dir={run_dir}",
        "seed=3",
        f"rollout_worker.temperature={temperature}",
        f"rollout_worker.top_p={top_p}",
        f"service.inference_service.backend={backend}",
        f"train_worker.total_train_steps={steps}",
        "algorithm.recompute_old_log_prob=true",
        "logger.dump_rollouts=true",
        "logger.backend=[]",
        "validate.validate_before_train=false",
        "validate.validate_at_end=false",
        "validate.eval.validate_freq=0",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "launch.train", *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({run_dir}): {proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "train/logprob_mismatch_max" in r]
    return {
        "max": max(r["train/logprob_mismatch_max"] for r in steps_rows),
        "mean": sum(r["train/logprob_mismatch_mean"] for r in steps_rows) / len(steps_rows),
        "behaviour": behaviour_gap(run_dir, temperature),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["local", "vllm"], default="local")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="logprob_temperature_") as root:
        results = [(t, p, run(t, p, args.backend, args.steps, root)) for t, p in CONFIGS]
    base = results[0][2]["max"]
    print(f"backend={args.backend}, {args.steps} steps each, default task, seed 3")
    print(
        "| temperature | top_p | mismatch max | mismatch mean | max / baseline | -log(top_p) | engine vs logits/T |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for t, p, r in results:
        ratio = r["max"] / base if base > 0 else float("inf")
        print(
            f"| {t} | {p} | {r['max']:.2e} | {r['mean']:.2e} | {ratio:.3g}x | {-math.log(p) + 0.0:.3f} | "
            f"{r['behaviour']:.2e} |"
        )


if __name__ == "__main__":
    main()
