"""Checkpoint save and load throughput against ``dd`` on the same filesystem.

One run, on ``--dir`` (default: a temp dir under ``outputs/``, where a run's ``run_dir`` goes by
default, so the same filesystem). The model is the project's tiny Llama scaled up to ``--gb`` of fp32
weights (hidden 2048, intermediate 5632, as many layers as it takes), trained by the real
``PolicyTrainer`` with AdamW state populated (one optimizer step on zero gradients), so a
checkpoint costs what it costs in a run: ``model/`` (HF safetensors) + ``optimizer/rank_0.safetensors`` (2x
the weights) + ``state.h5``, through ``TrainWorker.save_checkpoint`` -> ``CheckpointManager.save``.

Measured, interleaved with their baselines in every repeat (the medians are printed; the machine is
shared, so the pairs matter more than the absolute numbers):

- ``dd if=/dev/zero of=F bs=16M count=N conv=fsync`` of the same number of bytes as the path it is
  compared with (the weights; the whole checkpoint), before and after it, and the same ``dd`` from a
  file of random bytes in ``/dev/shm`` (this VM's disk stores zeros ~3x faster than data; the goal
  is judged against random data);
- the weights alone: ``write_hf_model_dir(..., fsync=True)`` (what every checkpoint writes);
- the same checkpoint with ``torch.save``'s CRC32 off (a proposal for the engine, not its code);
- a whole checkpoint: ``TrainWorker.save_checkpoint()`` (gather, safetensors, optimizer, state.h5,
  fsyncs, rename, COMPLETE, latest, pruning of the previous one);
- cold-cache reads: ``dd if=F of=/dev/null bs=16M`` against ``read_safetensors_dir`` (into new
  tensors), ``PolicyTrainer.load_checkpoint`` into the trained engine (weights and optimizer
  state read in place into its live tensors), and ``load_checkpoint`` into a second engine whose
  optimizer has no state yet (what a resumed process has after ``init_model``: 2 GB of new memory
  to fault in); what a resume adds: ``verify_checkpoint`` (every file against the digests in
  ``COMPLETE``), and it followed by ``load_checkpoint`` (reading what the check left cached). Before each read
  the page cache of every file read is dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (after
  an fsync), plus ``/proc/sys/vm/drop_caches`` (page cache only, ``1``) when it is writable, unless
  ``--no-drop-caches``: the table's footer says which was used.

Goal: >= 0.90x dd (of random data).

Then, when ``SLURM_CONF`` points at a cluster (the dev cluster: ``source slurm/dev/env.sh``), "signal
-> running again" (goal <= save time + 10 s), ``--requeue-runs`` times: a real ``launcher=slurm`` run
(fake LLM) gets ``scancel --signal=USR2`` after a few steps; measured from the signal to the job
PENDING again (its processes gone: what the run controls) and to RUNNING again (Slurm's requeue
hold of ``cred_expire`` + 1 s and its next scheduling pass come on top). The goal is judged on the
slowest run. ``--only-requeue`` skips the throughput part.

    python bench/checkpoint.py [--dir DIR] [--gb 1.0] [--repeat 3] [--no-drop-caches]
                               [--requeue-runs 3] [--only-requeue]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from nexrl_hpc.assembly import validate_config  # noqa: E402
from nexrl_hpc.checkpoint.digest import verify_checkpoint  # noqa: E402
from nexrl_hpc.checkpoint.hf import read_safetensors_dir, write_hf_model_dir  # noqa: E402
from nexrl_hpc.checkpoint.manager import COMPLETE  # noqa: E402
from nexrl_hpc.config import register_resolvers  # noqa: E402
from nexrl_hpc.models.tiny import materialize_base_model  # noqa: E402
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer  # noqa: E402
from nexrl_hpc.trainer.worker import TrainWorker  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9
BS = 16 << 20
HIDDEN, INTERMEDIATE = 2048, 5632
GOAL = 0.90


def layers_for(gb: float) -> int:
    per_layer = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN) * 4
    return max(1, round(gb * GB / per_layer))


def build(work: str, gb: float) -> tuple[TrainWorker, PolicyTrainer, str]:
    """The real trainer on a scaled-up tiny Llama, its AdamW state populated."""
    register_resolvers()
    with initialize_config_dir(
        config_dir=os.path.join(REPO, "configs"), version_base="1.3", job_name="bench"
    ):
        raw = compose(
            "rl_train",
            overrides=[
                f"run_dir={work}/run",
                f"model.tiny.hidden_size={HIDDEN}",
                f"model.tiny.intermediate_size={INTERMEDIATE}",
                f"model.tiny.num_hidden_layers={layers_for(gb)}",
                "model.tiny.num_attention_heads=16",
                "model.tiny.num_key_value_heads=16",
                "train_worker.max_ckpt_to_keep=1",
            ],
        )
    cfg: Any = validate_config(raw)
    base = materialize_base_model(cfg["model"], os.path.join(work, "base_model"))
    eng = PolicyTrainer(base)
    worker = TrainWorker(cfg, eng)
    eng.initialize_worker(worker.train_service_config())
    eng.init_model()
    assert eng.optimizer is not None
    for p in eng.model.parameters():
        p.grad = torch.zeros_like(p)
    eng.optimizer.step()  # AdamW creates exp_avg / exp_avg_sq: a checkpoint's real optimizer state
    eng.optimizer.zero_grad(set_to_none=True)
    return worker, eng, base


def tree_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in tree_files(path))


def drop_cache(path: str, use_drop_caches: bool) -> None:
    """Evict the page cache of every file under ``path`` (fsync first: dirty pages are not dropped)."""
    for f in tree_files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if use_drop_caches:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def timed(fn: Callable[[], Any]) -> float:
    return timed_result(fn)[0]


def timed_result(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class Baseline:
    """``dd`` writes/reads of ``nbytes`` on the benchmark's filesystem, from ``/dev/zero`` (the usual
    baseline) and from a file of random bytes kept in RAM (the VM disks measured here store zeros
    ~3x faster than data: weights and optimizer moments are not zeros)."""

    def __init__(self, work: str, nbytes: int):
        self.nbytes = -(-nbytes // BS) * BS
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else work
        fd, self.random_src = tempfile.mkstemp(prefix="bench-checkpoint-random-", dir=shm)
        with os.fdopen(fd, "wb") as f:
            rng = np.random.default_rng(0)
            for _ in range(self.nbytes // BS):
                f.write(rng.bytes(BS))
        self.files = {
            "zeros": os.path.join(work, "dd-zeros.bin"),
            "random": os.path.join(work, "dd-random.bin"),
        }

    def close(self) -> None:
        os.unlink(self.random_src)

    def write(self, kind: str, nbytes: int) -> float:
        """Seconds of ``dd bs=16M conv=fsync`` writing ``nbytes`` (rounded up to 16 MiB)."""
        src = "/dev/zero" if kind == "zeros" else self.random_src
        count = -(-nbytes // BS)
        cmd = [
            "dd",
            f"if={src}",
            f"of={self.files[kind]}",
            f"bs={BS}",
            f"count={count}",
            "conv=fsync",
            "status=none",
        ]
        return timed(lambda: subprocess.run(cmd, check=True)) * nbytes / (count * BS)

    def read(self, kind: str, drop_caches: bool) -> float:
        """Seconds per byte of a cold-cache ``dd bs=16M`` read of the last file written."""
        path = self.files[kind]
        drop_cache(path, drop_caches)
        cmd = ["dd", f"if={path}", "of=/dev/null", f"bs={BS}", "status=none"]
        return timed(lambda: subprocess.run(cmd, check=True)) / os.path.getsize(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under outputs/)")
    ap.add_argument("--gb", type=float, default=1.0, help="fp32 weights, GB (1e9 bytes)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-drop-caches", action="store_true", help="posix_fadvise only")
    ap.add_argument("--requeue-runs", type=int, default=3, help="signal -> running again: runs on Slurm")
    ap.add_argument("--only-requeue", action="store_true", help="skip the save/load throughput part")
    args = ap.parse_args()
    if args.only_requeue:
        print_requeue_rows(measure_requeues(args.requeue_runs))
        return
    if args.dir is None:
        os.makedirs("outputs", exist_ok=True)
        work = tempfile.mkdtemp(prefix="bench-checkpoint-", dir="outputs")
    else:
        os.makedirs(args.dir, exist_ok=True)
        work = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir)
    drop_caches = not args.no_drop_caches and os.access("/proc/sys/vm/drop_caches", os.W_OK)
    try:
        run(work, args.gb, args.repeat, drop_caches, args.requeue_runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


Sample = tuple[int, float, float, float]  # bytes, seconds, dd-zeros seconds, dd-random seconds


def run(work: str, gb: float, repeat: int, drop_caches: bool, requeue_runs: int) -> None:
    t0 = time.perf_counter()
    worker, eng, base_dir = build(work, gb)
    fresh = PolicyTrainer(base_dir)  # a second trainer, as a resumed process has it: model, no state
    fresh.initialize_worker(worker.train_service_config())
    fresh.init_model()
    state = eng.model.state_dict()
    weights_bytes = sum(t.numel() * t.element_size() for t in state.values())
    ckpt_bytes = 3 * weights_bytes  # weights + AdamW's two moments: what a checkpoint writes
    dd = Baseline(work, ckpt_bytes)
    print(f"set-up ({layers_for(gb)} layers, {work}): {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    export = os.path.join(work, "export")
    rows: dict[str, list[Sample]] = {}

    def bracketed(nbytes: int, ops: list[tuple[str, Callable[[], str]]]) -> list[str]:
        """dd (zeros, random) of ``nbytes``, the ops (each returns what it wrote), dd again: an op is
        compared with the mean of the dd runs around it (the shared disk drifts)."""
        before = [dd.write(kind, nbytes) for kind in ("zeros", "random")]
        done = []
        for name, fn in ops:
            s, path = timed_result(fn)
            done.append((name, s, path, tree_bytes(path)))  # measured now: a prune may remove it
        after = [dd.write(kind, nbytes) for kind in ("zeros", "random")]
        for name, s, _, b in done:
            z, r = ((x + y) / 2 * b / nbytes for x, y in zip(before, after))
            rows.setdefault(name, []).append((b, s, z, r))
        return [path for _, _, path, _ in done]

    def export_weights() -> str:
        write_hf_model_dir(state, base_dir, export, 4096 << 20, fsync=True)
        return export

    try:
        for i in range(repeat):
            bracketed(weights_bytes, [("weights: write_hf_model_dir (safetensors + fsync)", export_weights)])
            worker.set_train_step(2 * i + 1)
            (path,) = bracketed(
                ckpt_bytes,
                [
                    (
                        "checkpoint: TrainWorker.save_checkpoint (model + optimizer + state.h5)",
                        worker.save_checkpoint,
                    )
                ],
            )
            # cold reads of the step 2i+2 checkpoint, between cold dd reads of both dd files
            before = [dd.read(kind, drop_caches) for kind in ("zeros", "random")]
            drop_cache(export, drop_caches)
            s_weights = timed(lambda: read_safetensors_dir(export))
            drop_cache(path, drop_caches)
            s_ckpt = timed(lambda p=path: eng.load_checkpoint(p))
            assert fresh.optimizer is not None
            fresh.optimizer.state.clear()  # as after init_model in a new process: no state yet
            drop_cache(path, drop_caches)
            s_fresh = timed(lambda p=path: fresh.load_checkpoint(p))
            # what a resume adds: the files checked against COMPLETE's digests (cold), then the load,
            # which then reads what the check left in the page cache
            drop_cache(path, drop_caches)
            s_verify, problem = timed_result(lambda p=path: verify_checkpoint(p, COMPLETE))
            assert problem is None, problem
            s_after = timed(lambda p=path: eng.load_checkpoint(p))
            after = [dd.read(kind, drop_caches) for kind in ("zeros", "random")]
            for name, s, p in (
                ("weights: read_safetensors_dir into new tensors (cold cache)", s_weights, export),
                ("checkpoint: PolicyTrainer.load_checkpoint (cold cache)", s_ckpt, path),
                (
                    "checkpoint: load_checkpoint, no optimizer state yet (new memory; cold cache)",
                    s_fresh,
                    path,
                ),
                ("checkpoint: verify_checkpoint, the digests in COMPLETE (cold cache)", s_verify, path),
                (
                    "checkpoint: a resume: verify_checkpoint + load_checkpoint (cold cache)",
                    s_verify + s_after,
                    path,
                ),
            ):
                b = tree_bytes(p)
                z, r = ((x + y) / 2 * b for x, y in zip(before, after))
                rows.setdefault(name, []).append((b, s, z, r))
            print(f"repeat {i + 1}/{repeat} done", file=sys.stderr)
    finally:
        dd.close()
    print_table(rows, repeat, drop_caches, measure_requeues(requeue_runs))


class Requeue(NamedTuple):
    """One preempted run, seconds from the signal (save: the preemption checkpoint's own seconds)."""

    pending: float  # the job PENDING again: every process of the allocation gone
    running: float  # the job RUNNING again
    training: float  # the first step trained after the resume
    save: float


def measure_requeues(runs: int) -> list[Requeue] | None:
    """``runs`` measurements on the cluster SLURM_CONF points at; None without one."""
    if not (os.environ.get("SLURM_CONF") and shutil.which("sbatch")):
        return None
    found = []
    for i in range(runs):
        one = measure_requeue()
        if one is not None:
            found.append(one)
        print(f"requeue run {i + 1}/{runs}: {one}", file=sys.stderr)
    return found


def measure_requeue() -> Requeue | None:
    """A real run (launcher=slurm, fake LLM) on the cluster SLURM_CONF points at: USR2 after a few
    steps, then the job's state polled every 50 ms until it runs again and trains a step."""
    import json
    import re
    import subprocess

    os.makedirs("outputs", exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="bench-requeue-", dir="outputs")
    args = [
        sys.executable,
        "-m",
        "launch.train",
        "launcher=slurm",
        f"run_dir={os.path.abspath(run_dir)}",
        "train_worker.total_train_steps=500",
        "service.inference_service.backend=fake",
        "service.inference_service.fake_latency_ms=100",
        "data.batch_size=8",
        "validate.validate_before_train=false",
        "validate.validate_at_end=false",
        "validate.eval.validate_freq=0",
        "logger.backend=[]",
    ]
    subprocess.run(args, check=True, capture_output=True, text=True)
    job = json.loads(Path(run_dir, "launcher.json").read_text())["job_id"]
    metrics = os.path.join(run_dir, "metrics.jsonl")

    def steps() -> int:
        return Path(metrics).read_text().count("train/reward_mean") if os.path.exists(metrics) else 0

    def job_field(name: str) -> str:
        out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        return out.split(f"{name}=")[1].split()[0]

    try:
        deadline = time.monotonic() + 300
        while steps() < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        t0 = time.monotonic()
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        pending = None
        while True:
            state, restarts = job_field("JobState"), job_field("Restarts")
            if restarts == "1" and state == "PENDING" and pending is None:
                pending = time.monotonic() - t0
            # RUNNING with Restarts=1 was seen once right after the requeue, before COMPLETING:
            # running again counts only after PENDING
            if pending is not None and state == "RUNNING":
                break
            if time.monotonic() - t0 > 300:
                return None
            time.sleep(0.05)
        running = time.monotonic() - t0
        saves = re.findall(
            r"saved checkpoint \S+_(\d+) in ([0-9.]+)s", Path(run_dir, "train.log").read_text()
        )
        saved_step, save = (int(saves[-1][0]), float(saves[-1][1])) if saves else (0, float("nan"))
        while steps() <= saved_step and time.monotonic() - t0 < 300:  # a step past the checkpoint's
            time.sleep(0.1)
        training = time.monotonic() - t0
        return Requeue(pending, running, training, save)
    finally:
        subprocess.run(["scancel", job])
        deadline = time.monotonic() + 60  # its ranks write into run_dir until they are gone
        while (
            time.monotonic() < deadline
            and subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip()
        ):
            time.sleep(0.5)
        shutil.rmtree(run_dir, ignore_errors=True)


def print_table(
    rows: dict[str, list[Sample]], repeat: int, drop_caches: bool, requeues: list[Requeue] | None
) -> None:
    print(
        "| path | GB | seconds | GB/s | dd zeros GB/s | ratio vs dd zeros | dd random GB/s | ratio vs dd random | goal |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, samples in rows.items():
        b = statistics.median(x[0] for x in samples)
        s = statistics.median(x[1] for x in samples)
        cells = [name, f"{b / GB:.2f}", f"{s:.2f}", f"{b / GB / s:.2f}"]
        ratios = []
        for k in (2, 3):  # ratio per repeat (against the dd runs around it), then the median
            cells.append(f"{statistics.median(x[0] / x[k] for x in samples) / GB:.2f}")
            ratios.append(statistics.median(x[k] / x[1] for x in samples))
            cells.append(f"{ratios[-1]:.2f}x")
        met = "met" if ratios[1] >= GOAL else "NOT met"
        cells.append(f">= {GOAL:.2f}x vs dd random: {met}")
        print("| " + " | ".join(cells) + " |")
    how = "posix_fadvise(DONTNEED) + /proc/sys/vm/drop_caches=1" if drop_caches else "posix_fadvise(DONTNEED)"
    print(f"\nmedian of {repeat}; dd bs=16M, writes conv=fsync, each op between dd runs; cold cache: {how}\n")
    print_requeue_rows(requeues)


def print_requeue_rows(requeues: list[Requeue] | None) -> None:
    """One column per run; the goal is judged on the slowest."""
    if not requeues:
        print(
            "signal -> running again: not measured (no Slurm cluster: SLURM_CONF unset, or every run timed out)"
        )
        return
    runs = " | ".join(f"run {i + 1}" for i in range(len(requeues)))
    print(f"| seconds from the signal (USR2, launcher=slurm) | {runs} | median | max | goal |")
    print("|---" * (len(requeues) + 4) + "|")
    met = "met" if all(r.running <= r.save + 10 for r in requeues) else "NOT met"
    for name, field, goal in (
        ("preemption checkpoint saved (its own seconds)", "save", ""),
        ("job PENDING again: every process gone", "pending", ""),
        ("job RUNNING again", "running", f"<= save time + 10 s in every run: {met}"),
        ("first step trained after the resume (for reference)", "training", ""),
    ):
        values = [getattr(r, field) for r in requeues]
        cells = [f"{v:.2f}" for v in values] + [f"{statistics.median(values):.2f}", f"{max(values):.2f}"]
        print(f"| {name} | " + " | ".join(cells) + f" | {goal} |")


if __name__ == "__main__":
    main()
