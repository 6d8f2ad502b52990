"""PNG curves of a run in ``<run_dir>/plots/``, drawn from ``metrics.jsonl`` (matplotlib, Agg).

Why a subprocess (``PlotRefresher``): drawing costs about a CPU-second; in the run's process it would
hold the GIL the trainer and rollout threads need, and a plotting bug could take the run down. The
run starts ``python -m nexrl_hpc.tracking.plots --nice RUN_DIR`` after a validation (at most every
``logger.plots.min_interval_s``, one at a time) and at the end (it finishes after the run exits;
inside a Slurm job the run waits up to ``logger.plots.timeout_s`` for it); a drawing that fails is
logged (and its error kept in ``plots/drawing.log``), never raised. ``launch.status --plot``
draws in its own process. Each PNG is replaced atomically; a curve whose metrics the run did not
log is not drawn.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from nexrl_hpc.tracking.timing import TIMING_PARTS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from nexrl_hpc.config.schema import PlotsConfig

logger = logging.getLogger(__name__)

PLOTS_DIR = "plots"
DRAWING_LOG = "drawing.log"  # the last drawing's stderr: an "error: ..." last line when it failed
# name -> (title, metric keys drawn as lines): the first key bold, the others thin
LINE_PLOTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "reward": ("train reward (batch mean, band: ± std within the batch's min..max)", ("train/reward_mean",)),
    "zero_std_group_frac": (
        "groups whose rewards are all equal (no advantage: nothing to learn)",
        ("train/zero_std_group_frac",),
    ),
    "loss": ("loss", ("train/loss",)),
    "grad_norm": ("gradient norm", ("train/grad_norm",)),
    "entropy": ("policy entropy (per token)", ("actor/entropy",)),
    "logprob_mismatch": (
        "|trainer - engine| log-prob of sampled tokens",
        ("train/logprob_mismatch_mean", "train/logprob_mismatch_max"),
    ),
    "response_length": (
        "response length (tokens)",
        ("train/response_length_mean", "train/response_length_min", "train/response_length_max"),
    ),
    "throughput": (
        "throughput (per second of step time)",
        ("perf/generated_tokens_per_s", "perf/trained_tokens_per_s"),
    ),
}
VAL_FIRST = ("val/accuracy", "val/reward", "val/is_correct")  # drawn first when present
VAL_SKIP = {"val/num_samples", "val/filtered_long_prompts"}
VAL_FAILURES = "val/reward/"  # the reward runner's errors and timeouts: drawn when one happened
MAX_VAL_PANELS = 12


def read_metrics(path: str) -> list[dict[str, Any]]:
    """metrics.jsonl's lines (a torn last line of a run still writing is skipped)."""
    rows = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return rows


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def validation_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The validation metrics, one panel each: every score the run logged as ``val/*`` (whatever
    the task names them), zeros included (an accuracy of 0 at every validation is news, not noise);
    counters left out, and the reward runner's failure rates (``val/reward/errors``, ...) unless
    one was not 0. Order: ``VAL_FIRST``, then those that moved off 0, then those that stayed 0
    (the panels are capped at ``MAX_VAL_PANELS``: the ones left out are those)."""
    found: dict[str, bool] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("val/") and k not in VAL_SKIP and isinstance(v, (int, float)):
                found[k] = found.get(k, False) or v != 0
    keys = [k for k, moved in found.items() if moved or not k.startswith(VAL_FAILURES)]
    return sorted(
        keys,
        key=lambda k: (VAL_FIRST.index(k) if k in VAL_FIRST else len(VAL_FIRST), not found[k], k),
    )


def reward_band(train: list[dict[str, Any]]) -> tuple[list[int], list[float], list[float]]:
    """The reward plot's band per step: mean ± std, clipped to the rewards that step observed
    (``train/reward_min`` .. ``train/reward_max``), so the band never claims a reward no sample got
    (below 0 or above 1 for 0/1 rewards). Steps without a std: none."""
    std = dict(zip(*_series(train, "train/reward_std")))
    low = dict(zip(*_series(train, "train/reward_min")))
    high = dict(zip(*_series(train, "train/reward_max")))
    steps, lows, highs = [], [], []
    for x, y in zip(*_series(train, "train/reward_mean")):
        if x in std:
            steps.append(x)
            lows.append(max(y - std[x], low.get(x, -math.inf)))
            highs.append(min(y + std[x], high.get(x, math.inf)))
    return steps, lows, highs


def write_plots(run_dir: str) -> list[str]:
    """Draw every curve the run's metrics allow; the PNGs written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    train = [r for r in rows if "train/reward_mean" in r]
    out_dir = os.path.join(run_dir, PLOTS_DIR)
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):  # left by a drawing that was stopped (not one in progress)
        path = os.path.join(out_dir, name)
        if ".tmp-" in name and time.time() - os.path.getmtime(path) > 600:
            os.remove(path)
    written: list[str] = []

    def save(fig: Figure, name: str) -> None:
        path = os.path.join(out_dir, f"{name}.png")
        tmp = os.path.join(out_dir, f"{name}.tmp-{os.getpid()}.png")
        FigureCanvasAgg(fig).print_png(tmp, pil_kwargs={"compress_level": 1})  # fast beats small here
        os.replace(tmp, path)
        written.append(path)

    _line_plots(train, save)
    _validation_plot(rows, save)
    _step_time_plot(train, save)
    return written


def _line_plots(train: list[dict[str, Any]], save: Callable[[Figure, str], None]) -> None:
    """One PNG per entry of ``LINE_PLOTS`` that has data (the reward with its spread)."""
    from matplotlib.figure import Figure

    for name, (title, keys) in LINE_PLOTS.items():
        series = [(k, *_series(train, k)) for k in keys]
        if not any(xs for _, xs, _ in series):
            continue
        fig = Figure(figsize=(6.4, 3.6), dpi=100)
        # fixed: tight_layout doubles the cost
        fig.subplots_adjust(left=0.11, right=0.97, top=0.9, bottom=0.14)
        ax = fig.add_subplot()
        for i, (key, xs, ys) in enumerate(series):
            if xs:
                ax.plot(xs, ys, label=key, linewidth=1.6 if i == 0 else 0.8, alpha=1.0 if i == 0 else 0.6)
        band = reward_band(train) if name == "reward" else ([], [], [])
        if band[0]:
            ax.fill_between(*band, alpha=0.2)
        if name == "zero_std_group_frac":
            ax.set_ylim(-0.02, 1.02)  # a fraction: its whole range, so 0.3 does not look like 1
        if name == "logprob_mismatch" and all(y > 0 for _, _, ys in series for y in ys):
            ax.set_yscale("log")
        _finish(ax, title, legend=len(keys) > 1)
        save(fig, name)


def _validation_plot(rows: list[dict[str, Any]], save: Callable[[Figure, str], None]) -> None:
    """One panel per validation metric (at most ``MAX_VAL_PANELS``), in one PNG."""
    from matplotlib.figure import Figure

    val_keys = validation_keys(rows)[:MAX_VAL_PANELS]
    if not val_keys:
        return
    cols = min(3, len(val_keys))
    nrows = math.ceil(len(val_keys) / cols)
    fig = Figure(figsize=(3.6 * cols, 2.6 * nrows), dpi=100)
    fig.subplots_adjust(
        left=0.08 * 3 / cols,
        right=0.98,
        top=1 - 0.1 / nrows,
        bottom=0.14 / nrows,
        wspace=0.35,
        hspace=0.6,
    )
    for i, key in enumerate(val_keys):
        ax = fig.add_subplot(nrows, cols, i + 1)
        xs, ys = _series(rows, key)
        ax.plot(xs, ys, marker="o", markersize=3)
        _finish(ax, key, legend=False)
    save(fig, "validation")


def _step_time_plot(train: list[dict[str, Any]], save: Callable[[Figure, str], None]) -> None:
    """Where each step's seconds went, stacked (parts too thin to see left out)."""
    from matplotlib.figure import Figure

    steps = _series(train, "timing/step_s")[0]
    parts = [(k, ys) for k in TIMING_PARTS for xs, ys in [_series(train, k)] if xs == steps]
    total = sum(sum(ys) for _, ys in parts)
    parts = [(k, ys) for k, ys in parts if sum(ys) > 1e-3 * total]  # parts too thin to see: not in the legend
    if not (steps and parts):
        return
    fig = Figure(figsize=(7.6, 3.8), dpi=100)
    fig.subplots_adjust(left=0.09, right=0.78, top=0.9, bottom=0.13)  # the legend on the right
    ax = fig.add_subplot()
    ax.stackplot(
        steps,
        *[[max(y, 0.0) for y in ys] for _, ys in parts],
        labels=[k.removeprefix("timing/").removesuffix("_s") for k, _ in parts],
    )
    ax.set_ylabel("seconds")
    _finish(ax, "step time: where each step's seconds went (sums to timing/step_s)", legend=False)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    save(fig, "step_time")


def _finish(ax: Axes, title: str, legend: bool) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)


class PlotRefresher:
    """Starts the drawing subprocess (see the module docstring); never raises."""

    def __init__(self, run_dir: str, cfg: PlotsConfig) -> None:
        self._run_dir = run_dir
        self._enabled = cfg["enable"]
        self._min_interval_s = cfg["min_interval_s"]
        self._timeout_s = cfg["timeout_s"]
        self._proc: subprocess.Popen[bytes] | None = None
        self._last_start = time.monotonic()  # no drawing in the first interval: nothing much to draw yet

    def refresh(self, final: bool = False) -> None:
        """Draw now in the background: after a validation (skipped while a drawing runs or within
        ``min_interval_s`` of the last), or ``final`` (always; a drawing in progress is replaced)."""
        metrics = os.path.join(self._run_dir, "metrics.jsonl")
        if not self._enabled or not os.path.exists(metrics) or not os.path.getsize(metrics):
            return  # nothing to draw (a run that failed while starting)
        try:
            if self._running():
                if not final:
                    return
                self._end(kill=True)
            if not final and time.monotonic() - self._last_start < self._min_interval_s:
                return
            self._start()
        except Exception:
            logger.exception("could not start drawing the run's plots")

    def close(self, leaving: bool = False) -> None:
        """The run ends. A drawing in progress finishes on its own after the run's exit (the run does
        not wait for it), except inside a Slurm job, whose end would kill it: there the run waits up
        to ``timeout_s``. ``leaving`` (a preempted run leaving at once): stop it now."""
        try:
            if self._proc is None:
                return
            if leaving:
                self._end(kill=True)
            elif os.environ.get("SLURM_JOB_ID"):
                try:
                    self._proc.wait(timeout=self._timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning(
                        "plots: the last drawing took over logger.plots.timeout_s=%ss", self._timeout_s
                    )
                self._end(kill=True)
        except Exception:
            logger.exception("could not finish drawing the run's plots")

    def _running(self) -> bool:
        if self._proc is None:
            return False
        if self._proc.poll() is None:
            return True
        self._end(kill=False)
        return False

    def _start(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, MPLBACKEND="Agg")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        os.makedirs(os.path.join(self._run_dir, PLOTS_DIR), exist_ok=True)
        with open(os.path.join(self._run_dir, PLOTS_DIR, DRAWING_LOG), "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "nexrl_hpc.tracking.plots", "--nice", self._run_dir],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=env,
                start_new_session=True,  # a Ctrl-C of the run does not cut its last drawing short
            )
        self._last_start = time.monotonic()

    def _end(self, kill: bool) -> None:
        """Reap the drawing (killed first if ``kill`` and still running); log how a failed one failed."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if kill and proc.poll() is None:
            proc.kill()
        if proc.wait() > 0:
            logger.warning("plots: drawing failed: %s", drawing_error(self._run_dir))


def drawing_error(run_dir: str) -> str | None:
    """The last drawing's error (its log's ``error:`` line), or None when it did not fail."""
    try:
        with open(os.path.join(run_dir, PLOTS_DIR, DRAWING_LOG), errors="replace") as f:
            lines = f.read().strip().splitlines()
    except OSError:
        return None
    return lines[-1] if lines and lines[-1].startswith("error:") else None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--nice"]:  # the run's background drawing yields the CPU to the run
        args = args[1:]
        os.nice(10)
    if len(args) != 1:
        print("usage: python -m nexrl_hpc.tracking.plots [--nice] <run_dir>", file=sys.stderr)
        return 2
    try:
        written = write_plots(args[0])
    except Exception as exc:
        traceback.print_exc()
        print(f"error: drawing the plots failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
