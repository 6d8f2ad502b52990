"""Seeing a run: the step-time breakdown, the run's status file, launch.status, the PNG curves.

Hand-computed timelines and hand-built run directories for the edge cases; the end-to-end runs
(tests/test_e2e.py, tests/test_preemption_exit.py, tests/test_agents_tool_task.py) check the same
on real runs."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from launch import status as status_cli
from nexrl_hpc.tracking.plots import PlotRefresher, reward_band, validation_keys, write_plots
from nexrl_hpc.tracking.run_status import RunStatus, describe, read_status
from nexrl_hpc.tracking.timing import TIMING_PARTS, StepTimeline, merge, rollout_intervals, split_wait
from tests.test_weight_sync_and_activity import make_wsc

PNG = b"\x89PNG\r\n\x1a\n"


# --- the step-time breakdown ----------------------------------------------------------------------
def test_a_wait_is_split_by_generation_then_reward_then_validation() -> None:
    """The trainer waits for its batch; a validation beside the batch's rollouts counts only where
    neither the batch's generation nor its scoring ran."""
    validation = [(100.0, 103.0)]
    generation = merge([(102.0, 106.0), (104.0, 108.0)])  # two trajectories, overlapping
    reward = merge([(107.5, 109.0)])
    assert generation == [(102.0, 108.0)]
    # 10 s waited over wall [100, 110]: generation 6 (102-108), reward 1 (108-109), validation 2, rest 1
    (gen, rew, val), rest = split_wait(10.0, (100.0, 110.0), [generation, reward, validation])
    assert (gen, rew, val, rest) == pytest.approx((6.0, 1.0, 2.0, 1.0))
    # the monotonic seconds decide the total, the wall clock only the fractions
    parts, rest = split_wait(5.0, (100.0, 110.0), [generation, reward, validation])
    assert parts + [rest] == pytest.approx([3.0, 0.5, 1.0, 0.5]) and sum(parts) + rest == 5.0
    # nothing overlapping: all of it is waiting
    assert split_wait(2.0, (0.0, 2.0), [generation, reward, validation]) == ([0.0, 0.0, 0.0], 2.0)


def test_rollout_intervals_merge_each_trajectorys_generation_and_scoring() -> None:
    times = [[10.0, 12.0, 12.5], [11.0, 13.0, 13.2], None, [20.0, 21.0, 21.0]]
    assert rollout_intervals(times) == {
        "generation": [(10.0, 13.0), (20.0, 21.0)],
        "reward": [(12.0, 12.5), (13.0, 13.2)],  # an agent episode (generated == scored) adds none
    }


def test_the_parts_of_a_step_sum_to_its_step_time() -> None:
    timeline = StepTimeline()
    timeline.start()
    time.sleep(0.03)  # waiting for the first batch
    timeline.end_wait()
    start = time.time()
    t0 = time.monotonic()
    time.sleep(0.01)  # the update
    update_s = time.monotonic() - t0
    timeline.add("timing/update_s", update_s)
    wall, t0 = time.time(), time.monotonic()
    time.sleep(0.005)  # a call the trainer waits in
    timeline.waited("timing/weight_sync_s", time.monotonic() - t0, (wall, time.time()))
    validations = [(start - 1.0, start - 0.005)]  # ended during the wait for the batch
    generation = [(start - 0.012, start)]  # the batch's generation: the wait's last 12 ms
    parts = timeline.line(validations, {"generation": generation, "reward": []})
    assert set(parts) == {*TIMING_PARTS, "timing/step_s"}
    assert sum(parts[k] for k in TIMING_PARTS) == pytest.approx(parts["timing/step_s"], abs=1e-12)
    assert parts["timing/update_s"] == update_s and parts["timing/weight_sync_s"] >= 0.005
    assert parts["timing/validation_s"] > 0.01 and parts["timing/generation_s"] > 0.0
    assert min(parts.values()) >= 0.0
    # the next line's window starts at this line: nothing carried over
    following = timeline.line([], {})
    assert following["timing/update_s"] == 0.0 and following["timing/step_s"] < parts["timing/step_s"]


def test_the_weight_sync_controller_reports_validation_intervals(tmp_path: Path) -> None:
    wsc, _, _, pool = make_wsc(tmp_path, "validate.eval.validate_freq=1", "train_worker.total_train_steps=3")
    wsc.sync_weight_to_rollout_service("default")
    wsc.start("default")
    before = time.time()
    assert wsc.validation_intervals(0.0) == []
    wsc.train_worker_notify_weight_update("train_worker", "default", 1)  # validation due
    (running,) = wsc.validation_intervals(0.0)
    assert before <= running[0] <= running[1] <= time.time()  # still running: it ends now
    wsc.end_validate("default")
    (ended,) = wsc.validation_intervals(before)
    assert ended[0] == running[0] and ended[1] >= running[1]
    assert wsc.validation_intervals(ended[1] + 1.0) == []  # ended before the window asked for


# --- the run's status file and launch.status ---------------------------------------------------------
def write_run(run_dir: Path, rows: list[dict[str, Any]], total: int = 4, status: dict | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(
        f"train_worker:\n  total_train_steps: {total}\n  checkpoint_path: {run_dir / 'checkpoints'}\n"
    )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if status is not None:
        (run_dir / "status.json").write_text(json.dumps(status))


def train_row(step: int, reward: float) -> dict[str, Any]:
    return {
        "step": step,
        "train/reward_mean": reward,
        "train/loss": 0.1 * step,
        "timing/step_s": 1.0,
        "timing/update_s": 0.6,
        "timing/wait_s": 0.4,
    }


def cli(run_dir: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    code = status_cli.main([str(run_dir), *flags])
    return code, capsys.readouterr().out


def test_status_file_records_start_and_end(tmp_path: Path) -> None:
    status = RunStatus(str(tmp_path / "run"))
    status.started()
    record = read_status(str(tmp_path / "run"))
    assert record is not None and record["state"] == "running" and record["pid"] == os.getpid()
    assert describe(record, None)["state"] == "running"  # this process is alive
    status.ended(1, "RunFailed: inference server unreachable")
    record = read_status(str(tmp_path / "run"))
    assert record is not None and record["ended_at"] >= record["started_at"]
    assert describe(record, None) == {
        "state": "failed",
        "exit_code": 1,
        "reason": "RunFailed: inference server unreachable",
    }
    status.ended(3, "signal SIGUSR2: checkpoint saved at step 2")
    assert describe(read_status(str(tmp_path / "run")), None)["state"] == "preempted"
    status.ended(0, "run finished")
    assert describe(read_status(str(tmp_path / "run")), None)["state"] == "finished"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


RUNNING = {"state": "running", "pid": 1, "host": "elsewhere", "started_at": 1.0}
ENDED_FAILED = {"state": "failed", "exit_code": 1, "reason": "ValueError: bad reward", "pid": 1, "host": "x"}


@pytest.mark.parametrize(
    ("record", "slurm", "state", "reason"),
    [
        (RUNNING, "CANCELLED", "cancelled", "Slurm CANCELLED: the run ended without recording why"),
        (RUNNING, "TIMEOUT", "timeout", "Slurm TIMEOUT: the run ended without recording why"),
        (RUNNING, "OUT_OF_MEMORY", "failed", "Slurm OUT_OF_MEMORY: the run ended without recording why"),
        (None, "FAILED", "failed", "Slurm FAILED: the run ended without recording why"),
        (ENDED_FAILED, "FAILED", "failed", "ValueError: bad reward"),  # the run knows why
        (
            {**ENDED_FAILED, "state": "preempted", "exit_code": 3, "reason": "signal SIGUSR2"},
            "PENDING",
            "preempted",
            "signal SIGUSR2; requeued, waiting to restart (Slurm PENDING)",
        ),
        (
            {**ENDED_FAILED, "state": "preempted", "exit_code": 3},
            "RUNNING",
            "running",
            "Slurm RUNNING; resuming after a preemption",
        ),
        (None, "PENDING", "pending", "Slurm PENDING"),
        (RUNNING, "RUNNING", "running", None),
        (RUNNING, None, "running", None),  # another host: its pid cannot be checked from here
    ],
)
def test_state_combines_the_run_and_slurm(
    record: dict | None, slurm: str | None, state: str, reason: str
) -> None:
    described = describe(record, slurm)
    assert (described["state"], described["reason"]) == (state, reason)


def test_a_run_killed_before_recording_its_end_shows_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pid = dead_pid()
    run_dir = tmp_path / "killed"
    write_run(
        run_dir,
        [train_row(1, 0.1)],
        status={"state": "running", "pid": pid, "host": socket.gethostname(), "started_at": time.time() - 5},
    )
    code, out = cli(run_dir, capsys)
    assert code == 0
    assert f"failed: the run's process (pid {pid}) is gone without recording an end" in out
    assert "step             1 / 4" in out


def test_status_shows_a_failed_run_as_failed_not_fresh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "failed"
    write_run(
        run_dir,
        [],
        status={
            "state": "failed",
            "exit_code": 1,
            "pid": 7,
            "host": "h",
            "started_at": 1.0,
            "ended_at": 2.0,
            "reason": "RunFailed: http://127.0.0.1:9 unreachable",
        },
    )
    code, out = cli(run_dir, capsys)
    assert code == 0
    lines = dict(
        line.split(None, 1) for line in out.splitlines() if not line.startswith(("run dir", "last "))
    )
    assert lines["state"].strip() == "failed (exit 1): RunFailed: http://127.0.0.1:9 unreachable"
    assert lines["step"].strip() == "0 / 4" and lines["reward"].strip() == "-"


def test_status_prints_every_validation_metric_and_a_reward_sparkline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An agent task logs val/is_correct (no val/accuracy): it is shown, whatever its name."""
    run_dir = tmp_path / "agent"
    rows = [train_row(s, r) for s, r in enumerate([0.0, 0.25, 0.5, 1.0], start=1)]
    rows.append({"step": 4, "val/reward": 0.75, "val/is_correct": 0.5, "val/num_samples": 64})
    write_run(
        run_dir,
        rows,
        status={
            "state": "finished",
            "exit_code": 0,
            "reason": "run finished",
            "pid": 1,
            "host": "h",
            "started_at": 1.0,
            "ended_at": 2.0,
        },
    )
    code, out = cli(run_dir, capsys)
    assert code == 0
    assert "finished (exit 0): run finished" in out and "step             4 / 4" in out
    assert "last validation  step 4: val/reward=0.7500, val/is_correct=0.5000, val/num_samples=64" in out
    assert "▁▃▅█  last 1.0000 (min 0.0000, max 1.0000)" in out
    code, out = cli(run_dir, capsys, "--json")
    status = json.loads(out)
    assert status["last_validation"] == {
        "step": 4,
        "val/reward": 0.75,
        "val/is_correct": 0.5,
        "val/num_samples": 64,
    }
    assert status["state"] == "finished" and status["rewards"] == [0.0, 0.25, 0.5, 1.0]


def test_sparkline_buckets_long_runs() -> None:
    assert status_cli.sparkline([1.0] * 5) == "▅" * 5
    line = status_cli.sparkline([float(i) for i in range(400)], width=40)
    assert len(line) == 40 and line[0] == "▁" and line[-1] == "█"
    assert status_cli.sparkline([0.0, 1.0], bars=status_cli.ASCII_BARS) == "_@"


def test_status_refuses_a_directory_without_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert status_cli.main([str(tmp_path)]) == 2
    assert "holds no run" in capsys.readouterr().err
    assert status_cli.main([str(tmp_path), "--bogus"]) == 2


# --- plots ----------------------------------------------------------------------------------------
def test_plots_are_drawn_from_metrics_and_listed_by_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    rows = [
        {
            **train_row(s, 0.1 * s),
            "train/grad_norm": 1.0 / s,
            "actor/entropy": 2.0 - 0.1 * s,
            "train/logprob_mismatch_max": 1e-6,
        }
        for s in range(1, 6)
    ]
    rows += [{"step": 5, "val/is_correct": 0.4, "val/reward/errors": 0.0, "val/num_samples": 8}]
    write_run(run_dir, rows, total=5)
    assert validation_keys(rows) == ["val/is_correct"]  # counters and failure rates that stayed 0 left out
    code, out = cli(run_dir, capsys, "--plot")
    assert code == 0
    names = {"reward", "loss", "grad_norm", "entropy", "logprob_mismatch", "validation", "step_time"}
    assert {p.stem for p in (run_dir / "plots").glob("*.png")} == names  # no response length logged: no curve
    for name in names:
        assert (run_dir / "plots" / f"{name}.png").read_bytes()[:8] == PNG
    assert "plots            " in out and "step_time.png" in out


def test_validation_is_drawn_when_every_validation_metric_is_0(tmp_path: Path) -> None:
    """A policy that never gets a validation answer right is the plot a user most needs to see."""
    run_dir = tmp_path / "run"
    rows = [train_row(s, 0.0) for s in (1, 2)]
    rows += [
        {"step": s, "val/accuracy": 0.0, "val/reward": 0.0, "val/reward/errors": 0.0, "val/num_samples": 8}
        for s in (0, 2)
    ]
    write_run(run_dir, rows)
    assert validation_keys(rows) == ["val/accuracy", "val/reward"]
    failing = [{**rows[-1], "val/reward/timeouts": 0.25, "val/format": 0.5}]  # moved off 0 first
    assert validation_keys(rows + failing) == [
        "val/accuracy",
        "val/reward",
        "val/format",
        "val/reward/timeouts",
    ]
    figures = drawn_figures(run_dir)
    axes = figures["validation"].axes
    assert [ax.get_title() for ax in axes] == ["val/accuracy", "val/reward"]
    assert [list(ax.lines[0].get_xdata()) for ax in axes] == [[0, 2], [0, 2]]
    assert [list(ax.lines[0].get_ydata()) for ax in axes] == [[0.0, 0.0], [0.0, 0.0]]
    assert (run_dir / "plots" / "validation.png").read_bytes()[:8] == PNG


def test_the_reward_band_stays_within_the_rewards_each_step_observed(tmp_path: Path) -> None:
    """mean ± std of 0/1 rewards runs past 0 and 1; the band is clipped to the step's min..max."""
    run_dir = tmp_path / "run"
    spread = [(0.1, 0.3, 0.0, 1.0), (0.5, 0.5, 0.0, 1.0), (0.9, 0.3, 0.0, 1.0), (0.5, 0.1, 0.25, 0.75)]
    rows = [
        {
            **train_row(s, mean),
            "train/reward_std": std,
            "train/reward_min": low,
            "train/reward_max": high,
            "train/zero_std_group_frac": 0.25 * (s - 1),
        }
        for s, (mean, std, low, high) in enumerate(spread, start=1)
    ]
    rows.append(train_row(5, 0.5))  # no std logged: no band at that step
    write_run(run_dir, rows)
    steps, lows, highs = reward_band(rows)
    assert steps == [1, 2, 3, 4]
    assert lows == pytest.approx([0.0, 0.0, 0.6, 0.4]) and highs == pytest.approx([0.4, 1.0, 1.0, 0.6])
    figures = drawn_figures(run_dir)
    (band,) = figures["reward"].axes[0].collections  # the data behind the drawn band
    ys = band.get_paths()[0].vertices[:, 1]
    assert ys.min() == pytest.approx(0.0) and ys.max() == pytest.approx(1.0)
    zero_std = figures["zero_std_group_frac"].axes[0]
    assert list(zero_std.lines[0].get_ydata()) == [0.0, 0.25, 0.5, 0.75]
    assert zero_std.get_ylim() == (-0.02, 1.02)
    assert (run_dir / "plots" / "zero_std_group_frac.png").read_bytes()[:8] == PNG


def drawn_figures(run_dir: Path) -> dict[str, Any]:
    """``write_plots``' figures by name, kept as they were drawn (the PNGs are written too)."""
    from matplotlib.backends import backend_agg

    figures: dict[str, Any] = {}
    print_png = backend_agg.FigureCanvasAgg.print_png

    def keep(canvas: Any, path: str, *args: Any, **kwargs: Any) -> None:
        figures[Path(path).name.split(".tmp-")[0]] = canvas.figure
        print_png(canvas, path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend_agg.FigureCanvasAgg, "print_png", keep)
        write_plots(str(run_dir))
    return figures


def test_a_failing_drawing_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, [{"step": "not a number", "train/reward_mean": 0.5}])
    refresher = PlotRefresher(str(run_dir), {"enable": True, "min_interval_s": 3600.0, "timeout_s": 60.0})
    refresher.refresh()  # within min_interval_s of the start: nothing drawn
    assert not (run_dir / "plots").exists()
    refresher.refresh(final=True)
    proc = refresher._proc
    assert proc is not None and proc.wait(timeout=120) == 1
    with caplog.at_level(logging.WARNING):
        refresher.refresh(final=True)  # reaps the failed one (and logs why), starts another
        refresher.close(leaving=True)
    assert "plots: drawing failed: error: drawing the plots failed: ValueError" in caplog.text


def test_the_metrics_line_is_written_at_once_and_tensorboard_gets_every_row_in_order(tmp_path: Path) -> None:
    """TensorBoard's events are written by a thread of their own (the trainer's step does not wait
    for them); the jsonl line is on disk when ``post`` returns, and closing writes what was posted."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nexrl_hpc.tracking.experiment import ExperimentLogger
    from tests.conftest import compose_config

    logger_ = ExperimentLogger(compose_config(["logger.backend=[]"]), str(tmp_path), None)
    for step in range(1, 201):
        logger_.post("all", {"train/reward_mean": step / 10, "train/loss": -step, "note": "text"}, step)
        last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
        assert last["step"] == step and last["train/reward_mean"] == step / 10
    logger_.post("jsonl", {"val/accuracy": 0.5}, 200)  # jsonl only: never in TensorBoard
    logger_.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["train/loss", "train/reward_mean"]
    rewards = events.Scalars("train/reward_mean")
    assert [e.step for e in rewards] == list(range(1, 201))
    assert [round(e.value, 4) for e in rewards] == [round(s / 10, 4) for s in range(1, 201)]
