"""``python -m launch.status <run_dir> [--plot] [--samples] [--json]``: where a run stands.

State (running / finished / failed / preempted, and pending / cancelled / timeout from Slurm), with
the exit code and the reason; step out of the total, a reward sparkline, the last validation's
metrics (whatever the task calls them), the last checkpoint, the plots. It only reads what the run
wrote (``status.json``, ``metrics.jsonl``, ``config.yaml``, the checkpoint folder, ``plots/``;
nexrl_hpc/tracking owns them) and, for launcher=slurm runs (``launcher.json``), asks sacct: a job
Slurm ended before the run could record why still shows as failed, cancelled or timed out.
``--plot`` redraws ``<run_dir>/plots/`` from metrics.jsonl first; ``--samples`` adds the last step's
decoded samples (``<run_dir>/samples/``: prompt, response, reward, advantage). Exit code 0; 1 when
``--plot`` failed; 2 when the directory holds no run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

BARS = "▁▂▃▄▅▆▇█"
ASCII_BARS = "_.-=+*#@"


def sparkline(values: list[float], width: int = 40, bars: str = BARS) -> str:
    """``values`` as one line of bars (averaged into ``width`` buckets), lowest to highest."""
    if not values:
        return ""
    if len(values) > width:
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:])]
    low, high = min(values), max(values)
    if high == low:
        return bars[len(bars) // 2] * len(values)
    return "".join(bars[min(len(bars) - 1, int((v - low) / (high - low) * len(bars)))] for v in values)


def run_status(run_dir: str) -> dict[str, Any]:
    import yaml

    from nexrl_hpc.checkpoint.manager import find_latest_checkpoint
    from nexrl_hpc.tracking.plots import PLOTS_DIR, read_metrics
    from nexrl_hpc.tracking.run_status import describe, read_status

    status: dict[str, Any] = {"run_dir": os.path.abspath(run_dir)}
    slurm_state = None
    launcher = os.path.join(run_dir, "launcher.json")
    if os.path.exists(launcher):
        with open(launcher) as f:
            info = json.load(f)
        from nexrl_hpc.launcher.slurm import job_state

        status["job_id"] = info["job_id"]
        try:
            slurm_state = job_state(info["job_id"])
        except (OSError, RuntimeError, ValueError) as exc:
            slurm_state = f"unknown ({exc})"
        status["slurm_state"] = slurm_state
        status["logs"] = [info["train_log"], info["stderr"][0]]
        status["elastic_jobs"] = elastic_job_states(info.get("elastic_jobs", []), job_state)
    record = read_status(run_dir)
    status.update(describe(record, slurm_state))
    for key in ("pid", "host", "started_at", "ended_at"):
        status[key] = (record or {}).get(key)
    total = None
    config_path = os.path.join(run_dir, "config.yaml")
    checkpoints = os.path.join(run_dir, "checkpoints")
    if os.path.exists(config_path):
        with open(config_path) as f:
            config = yaml.safe_load(f)
        total = config["train_worker"]["total_train_steps"]
        checkpoints = config["train_worker"]["checkpoint_path"]
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    steps = [r for r in rows if "train/reward_mean" in r]
    vals = [r for r in rows if any(k.startswith("val/") for k in r)]
    status["step"] = steps[-1]["step"] if steps else 0
    status["total_steps"] = total
    status["rewards"] = [float(r["train/reward_mean"]) for r in steps if r["train/reward_mean"] is not None]
    status["reward_mean"] = status["rewards"][-1] if status["rewards"] else None
    status["last_validation"] = (
        {"step": vals[-1]["step"], **{k: v for k, v in vals[-1].items() if k.startswith("val/")}}
        if vals
        else None
    )
    status["last_checkpoint"] = find_latest_checkpoint(checkpoints) if os.path.isdir(checkpoints) else None
    plots = os.path.join(run_dir, PLOTS_DIR)
    status["plots"] = (
        sorted(n for n in os.listdir(plots) if n.endswith(".png")) if os.path.isdir(plots) else []
    )
    status["elastic"] = elastic_members(run_dir)
    return status


def elastic_job_states(job_ids: list[str], job_state: Any) -> dict[str, str]:
    """launcher.elastic's join jobs: each one's Slurm state."""
    states = {}
    for job_id in job_ids:
        try:
            states[job_id] = job_state(job_id)
        except (OSError, RuntimeError, ValueError) as exc:
            states[job_id] = f"unknown ({exc})"
    return states


def elastic_members(run_dir: str) -> dict[str, Any] | None:
    """Rollout ranks that joined the run (runtime.elastic): each one's state, and the refusals."""
    from nexrl_hpc.runtime.elastic import DOOR_DIR, MEMBERS_FILE

    path = os.path.join(run_dir, DOOR_DIR, MEMBERS_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            found: dict[str, Any] = json.load(f)
        return found
    except (OSError, ValueError):
        return None


def format_elastic(elastic: dict[str, Any]) -> list[tuple[str, str]]:
    """One line for the joined ranks, then one per rank: its state, since when, its join time."""
    members = elastic["members"]
    counts = {s: sum(1 for m in members if m["state"] == s) for s in ("joined", "starting", "left", "ended")}
    lines = [
        (
            "elastic",
            f"{counts['joined']} joined, {counts['starting']} starting, {counts['left']} left, "
            f"{counts['ended']} served to the end, "
            f"{elastic['refused']} refused (start {elastic['generation']} of the run)",
        )
    ]
    for m in members:
        job = f", Slurm job {m['job']}" if m.get("job") else ""
        joined_in = (
            f", join time {m['first_task_at'] - m['started_at']:.1f} s"
            if m.get("first_task_at") and m.get("started_at")
            else ""
        )
        reason = f": {m['reason']}" if m.get("reason") else ""
        lines.append(
            (
                f"  rank {m['rank']}",
                f"{m['state']} since {_when(m['since'])} (host {m['host']}, pid {m['pid']}{job}){joined_in}{reason}",
            )
        )
    return lines


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _bars() -> str:
    try:
        BARS.encode(sys.stdout.encoding or "ascii")
        return BARS
    except (UnicodeEncodeError, LookupError):
        return ASCII_BARS


def format_status(status: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) lines for a person."""
    state = status["state"]
    if status.get("exit_code") is not None:
        state += f" (exit {status['exit_code']})"
    if status.get("reason"):
        state += f": {status['reason']}"
    lines = [("run dir", status["run_dir"]), ("state", state)]
    if "job_id" in status:
        lines.append(("slurm", f"job {status['job_id']}: {status['slurm_state']}"))
    if status.get("pid") is not None:
        ended = f", ended {_when(status['ended_at'])}" if status.get("ended_at") else ""
        lines.append(
            (
                "process",
                f"pid {status['pid']} on {status['host']}, started {_when(status['started_at'])}{ended}",
            )
        )
    lines.append(
        ("step", f"{status['step']} / {status['total_steps'] if status['total_steps'] is not None else '?'}")
    )
    rewards = status["rewards"]
    if rewards:
        spark = sparkline(rewards, bars=_bars())
        lines.append(
            ("reward", f"{spark}  last {rewards[-1]:.4f} (min {min(rewards):.4f}, max {max(rewards):.4f})")
        )
    else:
        lines.append(("reward", "-"))
    val = status["last_validation"]
    if val:
        shown = ", ".join(
            f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in val.items() if k != "step"
        )
        lines.append(("last validation", f"step {val['step']}: {shown}"))
    else:
        lines.append(("last validation", "-"))
    lines.append(("last checkpoint", status["last_checkpoint"] or "-"))
    plots = status["plots"]
    where = os.path.join(status["run_dir"], "plots")
    lines.append(("plots", f"{where}/ ({len(plots)} PNGs: {', '.join(plots)})" if plots else "-"))
    if "logs" in status:
        lines.append(("logs", ", ".join(status["logs"])))
    for job_id, state in (status.get("elastic_jobs") or {}).items():
        lines.append(("elastic job", f"{job_id}: {state}"))
    if status.get("elastic"):
        lines += format_elastic(status["elastic"])
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    flags = {a for a in args if a.startswith("-")}
    paths = [a for a in args if not a.startswith("-")]
    if len(paths) != 1 or flags - {"--plot", "--samples", "--json"}:
        print("usage: python -m launch.status <run_dir> [--plot] [--samples] [--json]", file=sys.stderr)
        return 2
    run_dir = paths[0]
    if not os.path.isdir(run_dir) or not any(
        os.path.exists(os.path.join(run_dir, name))
        for name in ("launcher.json", "config.yaml", "status.json")
    ):
        print(
            f"error: {run_dir} holds no run (no launcher.json, config.yaml or status.json)", file=sys.stderr
        )
        return 2
    code = 0
    if "--plot" in flags:
        from nexrl_hpc.tracking.plots import write_plots

        try:
            written = write_plots(run_dir)
            print(
                f"drew {len(written)} plots in {os.path.join(os.path.abspath(run_dir), 'plots')}",
                file=sys.stderr,
            )
        except Exception as exc:
            print(f"error: drawing the plots failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            code = 1
    status = run_status(run_dir)
    if "--samples" in flags:
        from nexrl_hpc.tracking.samples import last_samples

        for key, validation in (("samples", False), ("validation_samples", True)):
            found = last_samples(run_dir, validation)
            status[key] = {"step": found[0], "rows": found[1]} if found else None
    if "--json" in flags:
        print(json.dumps(status, indent=1, ensure_ascii=False))
        return code
    lines = format_status(status)
    width = max(len(label) for label, _ in lines)
    for label, text in lines:
        print(f"{label:<{width}}  {text}")
    if "--samples" in flags:
        print("\n".join(format_samples(status["samples"], status["validation_samples"])))
    return code


def format_samples(samples: dict[str, Any] | None, validation: dict[str, Any] | None = None) -> list[str]:
    """The last step's samples (then the last validation's) for a person: a header per row, then
    its prompt and response."""
    if not samples:
        return ["", "samples: none (logger.samples_per_step=0, or no step trained yet)"]
    lines = ["", f"samples of step {samples['step']} ({len(samples['rows'])} rows)"]
    for row in samples["rows"]:
        lines.append(
            f"--- row {row['row']}  uid {row['uid']}  group {row['group']}  reward {row['reward']:.4f}"
            f"  advantage {row['advantage']:+.4f}  {row['response_length']} response tokens"
            + (f" ({row['undecodable_tokens']} without a token)" if row.get("undecodable_tokens") else "")
        )
        lines += ["prompt:", *_indented(row["prompt"]), "response:", *_indented(row["response"])]
    if validation:
        lines += ["", f"validation samples of step {validation['step']} ({len(validation['rows'])} rows)"]
        for row in validation["rows"]:
            lines.append(
                f"--- uid {row['uid']}  reward {row['reward']:.4f}  {row['response_length']} response tokens"
            )
            lines += ["prompt:", *_indented(row["prompt"]), "response:", *_indented(row["response"])]
    return lines


def _indented(text: str) -> list[str]:
    return ["    " + line for line in (text.splitlines() or [""])]


if __name__ == "__main__":
    sys.exit(main())
