"""Who may read what a run writes: ``runtime.umask`` for every file of the run, its run dir locked.

Why: on a shared cluster the usual umask (022) leaves checkpoints, exported weights, logs, the
config and submitit's pickles world-readable, and a run dir others may list. With ``077`` (the
default) the run dir is 0700 and every file and directory the run creates is its user's alone;
``027`` lets the user's group read them; null leaves the inherited umask and modes alone.

The run's log (``train.log``) is opened by Hydra's logging before any of the run's code runs, so
before the umask is set: its handler (``PrivateFileHandler``, named in configs/rl_train.yaml's
``hydra.job_logging``) creates it 0600, and ``restrict_run_files`` then gives it the run's mode.
"""

from __future__ import annotations

import io
import logging
import os
import re
import stat
from typing import Any, cast

UMASK_KEY = "runtime.umask"
RUN_LOG = "train.log"
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
    run_dir = config["run_dir"]
    if spec is None:
        mask = os.umask(0)
        os.umask(mask)  # only read: the inherited one stays
    else:
        mask = int(spec, 8)
        os.umask(mask)
        os.makedirs(run_dir, exist_ok=True)
        info = os.stat(run_dir)
        if info.st_uid == os.geteuid() and not info.st_mode & stat.S_ISVTX:
            os.chmod(run_dir, 0o777 & ~mask)
    _give_mode(os.path.join(run_dir, RUN_LOG), 0o666 & ~mask)


def _give_mode(path: str, mode: int) -> None:
    """``path`` (when it exists and is this user's) gets ``mode``: a file created 0600 before the
    umask applied gets the one the run's files have."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != mode:
        os.chmod(path, mode)


class PrivateFileHandler(logging.FileHandler):
    """A ``logging.FileHandler`` whose file, when it creates it, is 0600 whatever the umask."""

    def _open(self) -> io.TextIOWrapper:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if "w" in self.mode else os.O_APPEND)
        fd = os.open(self.baseFilename, flags, 0o600)
        return cast(io.TextIOWrapper, open(fd, self.mode, encoding=self.encoding, errors=self.errors))
