"""``nexrl-join RUN_DIR`` (``python -m launch.join RUN_DIR``): a rollout rank joins a running job.

Started by hand or as its own Slurm job on any host that reaches the run's
``runtime.rpc.interface``, by the run's user (the credential in ``RUN_DIR/elastic/join.json`` is
that user's alone; nothing secret is read from the command line or the environment). It serves
rollouts until the run ends (exit 0), leaves on SIGTERM / SIGINT / SIGUSR1 / SIGUSR2 (exit 0:
its tasks in flight are re-issued), and exits 2 when the run refuses it (the reason on stderr).
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: nexrl-join RUN_DIR", file=sys.stderr)
        return 2
    run_dir = os.path.abspath(args[0])
    from nexrl_hpc.assembly.roles import ROLES
    from nexrl_hpc.runtime.elastic import JoinRefused
    from nexrl_hpc.runtime.elastic_rank import JoinedRank

    os.umask(0o077)  # the logs it writes in the run dir are this user's alone
    log_dir = os.path.join(run_dir, "logs")
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if os.path.isdir(log_dir):
        handlers.append(
            logging.FileHandler(os.path.join(log_dir, f"join_{os.uname().nodename}_{os.getpid()}.log"))
        )
    logging.basicConfig(
        level=logging.INFO,
        format="[%(asctime)s][joined][%(name)s][%(levelname)s] - %(message)s",
        handlers=handlers,
    )
    try:
        return JoinedRank(run_dir, ROLES).serve()
    except JoinRefused as exc:
        print(f"error: nexrl-join {run_dir}: {exc}", file=sys.stderr)
        return 2
    except (OSError, ConnectionError) as exc:
        print(f"error: nexrl-join {run_dir}: the run's door did not answer: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
