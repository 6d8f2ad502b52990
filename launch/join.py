"""``nexrl-join [--wait] RUN_DIR`` (``python -m launch.join``): a rollout rank joins a running job.

Started by hand or as its own Slurm job on any host that reaches the run's
``runtime.rpc.interface``, by the run's user (the credential in ``RUN_DIR/elastic/join.json`` is
that user's alone; nothing secret is read from the command line or the environment). It serves
rollouts until the run ends (exit 0), leaves on SIGTERM / SIGINT / SIGUSR1 / SIGUSR2 (exit 0:
its tasks in flight are re-issued), and exits 2 when the run refuses it (the reason on stderr).
``--wait`` (launcher.elastic's join jobs): first wait for the run's door to open, and after the run
stopped without ending (preempted, requeued) wait for its next start and join again as a new
member; exit 0 once the run has ended.
"""

from __future__ import annotations

import logging
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    started = time.time()  # the join time counts from here (or from the door found, with --wait)
    args = sys.argv[1:] if argv is None else argv
    wait = "--wait" in args
    paths = [a for a in args if a != "--wait"]
    if len(paths) != 1 or paths[0].startswith("-"):
        print("usage: nexrl-join [--wait] RUN_DIR", file=sys.stderr)
        return 2
    run_dir = os.path.abspath(paths[0])
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
    while True:  # --wait: through the run's requeues, until the run ends or this rank is told to leave
        try:
            if wait:
                if not wait_for_door(run_dir):
                    print(f"nexrl-join {run_dir}: the run ended before this rank could join", file=sys.stderr)
                    return 0
                started = time.time()
            rank = JoinedRank(run_dir, ROLES, started)
            code = rank.serve()
        except JoinRefused as exc:
            print(f"error: nexrl-join {run_dir}: {exc}", file=sys.stderr)
            return 2
        except (OSError, ConnectionError) as exc:
            if not wait:
                print(f"error: nexrl-join {run_dir}: the run's door did not answer: {exc}", file=sys.stderr)
                return 2
            logging.getLogger("launch.join").info("the run's door did not answer (%s): waiting", exc)
            time.sleep(2.0)
            continue
        if not wait or code == 0 or rank.left:
            return code
        logging.getLogger("launch.join").info("the run stopped (exit %d): waiting for its next start", code)


def wait_for_door(run_dir: str, poll_s: float = 2.0) -> bool:
    """``--wait`` (a join job that may start before the run, or while it is requeued): until the
    run's door is open (True), or the run has ended (False)."""
    from nexrl_hpc.runtime.elastic import JoinRefused, read_credential
    from nexrl_hpc.tracking.run_status import RunState, read_status

    logger = logging.getLogger("launch.join")
    logger.info("waiting for the run's door in %s", run_dir)
    while True:
        try:
            read_credential(run_dir)
            return True
        except JoinRefused:
            pass
        status = read_status(run_dir) or {}
        if status.get("state") in (RunState.FINISHED, RunState.FAILED):
            return False
        time.sleep(poll_s)


if __name__ == "__main__":
    sys.exit(main())
