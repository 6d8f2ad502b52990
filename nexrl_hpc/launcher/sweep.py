"""Hydra sweeps (``python -m launch.train -m ...``): say at the end where each point's run lives.

Whatever launched the points — the basic launcher (runs in this process), ``launcher=slurm`` (one
job per point, submitted) or ``hydra/launcher=submitit_slurm`` (Hydra's job array, awaited) — each
point is a run of its own in ``<sweep dir>/<point number>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class ListRunDirs(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        points = sorted((p for p in sweep.glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
        if points:
            print(f"sweep of {len(points)} run(s):", flush=True)
            for run_dir in points:
                print(f"  {run_dir.resolve()}{_where(run_dir)}", flush=True)


def _where(run_dir: Path) -> str:
    """`` (Slurm job N)`` for a point launcher=slurm submitted."""
    try:
        return f" (Slurm job {json.loads((run_dir / 'launcher.json').read_text())['job_id']})"
    except (OSError, ValueError, KeyError):
        return ""
