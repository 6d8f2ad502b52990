"""Metrics to ``metrics.jsonl`` and TensorBoard (always), wandb (when configured), a console progress bar;
PNG curves in ``plots/`` (drawn by a subprocess, tracking/plots.py); each step's decoded samples
(tracking/samples.py) as TensorBoard text and a wandb table.

On resume the jsonl is truncated to the resumed step, TensorBoard purges later events and later
steps' samples are removed, so a step never appears twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import sys
import threading
import time
import uuid
from typing import Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.tracking.plots import PlotRefresher
from nexrl_hpc.tracking.samples import SAMPLES, samples_markdown, truncate_samples

logger = logging.getLogger(__name__)

_SAMPLES_ITEM = "samples"  # a sink item that carries samples (TensorBoard text, wandb table), not metrics


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


def truncate_metrics(path: str, keep_through_step: int) -> None:
    """Drop lines with ``step`` > ``keep_through_step`` (a resumed run redoes those steps)."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line).get("step", 0) <= keep_through_step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a crash
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


class ConsoleProgress:
    """A tqdm bar over training steps showing reward, validation accuracy and rate."""

    def __init__(self, total_steps: int, initial_step: int):
        from tqdm import tqdm

        self._bar = tqdm(
            total=total_steps,
            initial=initial_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=0.5,
        )
        self._postfix: dict[str, str] = {}

    def update(self, data: dict[str, Any], step: int) -> None:
        if "train/reward_mean" in data:
            self._postfix["reward"] = f"{data['train/reward_mean']:.3f}"
            if step > self._bar.n:
                self._bar.update(step - self._bar.n)
        for key in ("val/accuracy", "val/reward"):
            if key in data:
                self._postfix[key.split("/")[1]] = f"{data[key]:.3f}"
                break
        self._bar.set_postfix(self._postfix, refresh=False)

    def close(self) -> None:
        self._bar.close()


class ExperimentLogger:
    def __init__(self, config: RLTrainConfig, run_dir: str, resume_step: int | None):
        self._lock = threading.Lock()
        self._config = config
        backends = set(config["logger"]["backend"])
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        truncate_samples(run_dir, resume_step or 0)  # a fresh run's samples/ holds only its own steps
        if resume_step is not None:
            truncate_metrics(self.metrics_path, resume_step)
        elif os.path.exists(self.metrics_path):
            os.replace(self.metrics_path, f"{self.metrics_path}.{int(time.time())}.old")
        self._jsonl = open(self.metrics_path, "a", buffering=1)  # noqa: SIM115 - open for the whole run
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(
            os.path.join(run_dir, "tensorboard"),
            purge_step=(resume_step + 1) if resume_step is not None else None,
        )
        self._console = (
            ConsoleProgress(config["train_worker"]["total_train_steps"], resume_step or 0)
            if "console" in backends
            else None
        )
        self._wandb: Any = None
        if "wandb" in backends:
            self._wandb = self._init_wandb(run_dir)
        self._plots = PlotRefresher(run_dir, config["logger"]["plots"])
        self._sink: queue.Queue[tuple[str, dict[str, Any], int] | None] = queue.Queue()
        self._sink_thread = threading.Thread(target=self._drain_sink, name="metrics-sink", daemon=True)
        self._sink_thread.start()

    def _init_wandb(self, run_dir: str) -> Any:
        import wandb

        wcfg = self._config["logger"]["wandb"]
        id_path = os.path.join(run_dir, "wandb_run_id")
        if os.path.exists(id_path):
            with open(id_path) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:8]  # stable across resumes: the same wandb run continues
            with open(id_path, "w") as f:
                f.write(run_id)
        return wandb.init(
            project=wcfg["project"],
            entity=wcfg["entity"],
            name=wcfg["name"],
            mode=wcfg["mode"],
            dir=run_dir,
            id=run_id,
            resume="allow",
            config=self._config,  # type: ignore[arg-type]
        )

    def post(
        self, backend: str = "all", data: dict[str, Any] | None = None, step: int | None = None, **_: Any
    ) -> None:
        """Log ``data`` at ``step`` to ``backend`` ("all", "jsonl", "tensorboard", "wandb" or "console").

        The jsonl line is written before this returns (a checkpoint saved next keeps it); the other
        backends get the row from a thread of their own, in order: TensorBoard's per-scalar events
        cost time every step, which the trainer's step would otherwise wait for."""
        if not data:
            return
        step = int(step or 0)
        with self._lock:
            if backend in ("all", "jsonl"):
                row = {"step": step, **{k: _clean(v) for k, v in data.items()}, "time": round(time.time(), 3)}
                self._jsonl.write(json.dumps(row) + "\n")
            if backend != "jsonl":
                self._sink.put((backend, dict(data), step))

    def post_samples(self, step: int, rows: list[dict[str, Any]], tag: str = SAMPLES) -> None:
        """A step's decoded samples (tracking/samples.py) to TensorBoard's text tab and, with wandb,
        a table, both under ``tag`` (``samples``; a validation's: ``validation_samples``); written by
        the sink thread, after what was posted before."""
        if rows:
            self._sink.put((_SAMPLES_ITEM, {"tag": tag, "rows": [dict(r) for r in rows]}, int(step)))

    def _drain_sink(self) -> None:
        """The metrics-sink thread: TensorBoard, wandb and the console, in the order posted."""
        while (item := self._sink.get()) is not None:
            backend, data, step = item
            try:
                self._write_sinks(backend, data, step)
            except Exception:  # a backend's failure must not stop the others or the run
                logger.exception("logging step %d to %s failed", step, backend)

    def _write_sinks(self, backend: str, data: dict[str, Any], step: int) -> None:
        if backend == _SAMPLES_ITEM:
            self._write_samples(data["tag"], data["rows"], step)
            return
        if backend in ("all", "tensorboard"):
            for key, value in data.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None and backend in ("all", "wandb"):
            self._wandb.log({k: v for k, v in data.items() if isinstance(v, (int, float))}, step=step)
        if self._console is not None and backend in ("all", "console"):
            self._console.update(data, step)

    def _write_samples(self, tag: str, rows: list[dict[str, Any]], step: int) -> None:
        self._tb.add_text(tag, samples_markdown(rows), step)
        if self._wandb is not None:
            import wandb

            columns: list[str | int] = list(rows[0])
            table = wandb.Table(columns=columns, data=[[row.get(str(c)) for c in columns] for row in rows])
            self._wandb.log({tag: table}, step=step)

    def refresh_plots(self, final: bool = False) -> None:
        """Redraw ``plots/`` in the background (after a validation; ``final``: at the end)."""
        self._plots.refresh(final)

    def close(self, leaving: bool = False) -> None:
        """Close every backend; the last drawing goes on (``PlotRefresher.close``), unless the run
        is ``leaving`` at once (preempted)."""
        self._sink.put(None)  # what was posted is written first
        self._sink_thread.join()
        with self._lock:
            self._jsonl.close()
            self._tb.flush()
            self._tb.close()
            if self._console is not None:
                self._console.close()
            if self._wandb is not None:
                self._wandb.finish()
        self._plots.close(leaving)
