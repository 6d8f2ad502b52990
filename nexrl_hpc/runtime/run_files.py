"""Who may read what a run writes: ``runtime.umask`` for every file of the run, its run dir locked.

Why: on a shared cluster the usual umask (022) leaves checkpoints, exported weights, logs, the
config and submitit's pickles world-readable, and a run dir others may list. With ``077`` (the
default) the run dir is 0700 and every file and directory the run creates is its user's alone;
``027`` lets the user's group read them; null leaves the inherited umask and modes alone.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any

UMASK_KEY = "runtime.umask"
_OCTAL = re.compile(r"0?[0-7]{3}")


def umask_problem(value: Any) -> str | None:
    """Why ``runtime.umask`` is not an octal mask like ``"077"`` (None: it is, it is null, or it is
    not a string at all, which the schema check reports)."""
    if not isinstance(value, str) or _OCTAL.fullmatch(value):
        return None
    return f"{value!r} is not an octal umask such as '077', or null"


def restrict_run_files(config: Any) -> None:
    """Set the process umask from ``runtime.umask`` and give the run dir the matching mode.

    Called first in every process of a run (each rank, the Slurm submitter, the controller), before
    it writes anything. The run dir is changed only when this user owns it and it is not a shared
    sticky directory (``run_dir=/tmp`` must not lock /tmp)."""
    spec = config["runtime"]["umask"]
    if spec is None:
        return
    mask = int(spec, 8)
    os.umask(mask)
    run_dir = config["run_dir"]
    os.makedirs(run_dir, exist_ok=True)
    info = os.stat(run_dir)
    if info.st_uid == os.geteuid() and not info.st_mode & stat.S_ISVTX:
        os.chmod(run_dir, 0o777 & ~mask)
