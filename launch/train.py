"""Entry point: ``python -m launch.train [key=value ...]`` (a Hydra app; ``-m`` sweeps).

The config is validated (every problem listed, exit code 2) before anything starts. Exit codes:
0 finished, 1 the run failed (reason printed), 2 bad config or a run dir another run holds, 3 stopped
at a checkpoint on the preemption signal, on SIGTERM inside a Slurm job, or before the job's end
(requeued under Slurm; run again to resume), 130 interrupted (SIGINT), 143 terminated (SIGTERM
outside Slurm); both stop in order.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig, open_dict

from nexrl_hpc.assembly import validate_config
from nexrl_hpc.config import register_resolvers
from nexrl_hpc.config.location import CONFIG_NAME, config_dir
from nexrl_hpc.config.task_choice import CUSTOM_TASK, custom_task_reason, overrides_of
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.launcher.preflight import preflight
from nexrl_hpc.runtime.preemption import catch_signal_early

CONFIG_DIR = config_dir()

logger = logging.getLogger("launch.train")


def _quiet_third_party() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    for name in ("httpx", "httpx2", "httpcore", "openai", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name=CONFIG_NAME)
def hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.get().mode == RunMode.MULTIRUN:  # each point of a sweep is its own run (and dirs)
        with open_dict(cfg):
            cfg.run_dir = HydraConfig.get().runtime.output_dir
    try:
        config = validate_config(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    from nexrl_hpc.runtime.gc_tuning import freeze_imports, hold_collections
    from nexrl_hpc.runtime.run_files import restrict_run_files

    restrict_run_files(config)  # before anything is written (Slurm jobs inherit it via sbatch)
    hold_collections(config["runtime"])  # no full GC passes over the imports' objects as they pile up
    if config["launcher"]["name"] == "slurm":
        _quiet_third_party()
        _exit_unless_ok(submit_to_slurm(config))
        return  # a sweep goes on with its next point
    if os.environ.get("SUBMITIT_EXECUTOR"):  # a task of a job of Hydra's submitit launcher
        from nexrl_hpc.launcher.slurm import job_config, run_job_task

        _quiet_third_party()
        run_job_task(job_config(config), HydraConfig.get().runtime.output_dir)  # returns: submitit stores it
        return
    _prewarm_inference_server(config)  # before any heavy import (transformers here), which it overlaps
    _quiet_third_party()
    from nexrl_hpc.assembly.roles import ROLES
    from nexrl_hpc.controller import run_controller  # heavy imports only once the config is valid
    from nexrl_hpc.inference.prewarm import discard_prewarmed
    from nexrl_hpc.runtime.mpi import exit_process, run_mpi
    from nexrl_hpc.runtime.preemption import PREEMPTED_EXIT

    freeze_imports(config["runtime"])
    grace_s = config["runtime_monitor"]["stop_timeout_s"]
    if config["launch_mode"] == "mpi":
        code = run_mpi(config, run_controller, ROLES, HydraConfig.get().runtime.output_dir)
        exit_process(code, grace_s)  # never hangs on dead peers' threads
    try:
        code = run_controller(config)
    finally:
        discard_prewarmed()  # a run that failed before starting its server
    if code == PREEMPTED_EXIT:  # the modules were aborted, not stopped: leave without the teardown
        exit_process(code, grace_s)
    _exit_unless_ok(code)


def _prewarm_inference_server(config: dict) -> None:
    """Local mode with the run's own local server: start the server's process now (its imports
    overlap this process's; it waits for the model), see nexrl_hpc.inference.prewarm."""
    inference = config["service"]["inference_service"]
    own_server = inference["backend"] == "local" and not inference["base_url"]
    if config["launch_mode"] == "local" and own_server and inference["local"]["prewarm"]:
        from nexrl_hpc.inference.prewarm import prewarm

        prewarm(inference["local"]["num_threads"], config["runtime"]["gc_thresholds"])


def _exit_unless_ok(code: int) -> None:
    """Exit with a failure code; on success return, so that a sweep (-m) runs its next point."""
    if code != 0:
        sys.exit(code)


def submit_to_slurm(config: dict) -> int:
    """launcher=slurm: submit (after the cluster-side checks), print where to look, maybe follow."""
    from nexrl_hpc.launcher.slurm import follow, submit

    if config["resume"]["mode"] == "disable":
        print("note: the job runs with resume.mode=auto (a requeued job must resume its run)")
    try:
        job, info = submit(config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    kind = f"heterogeneous job ({len(info['components'])} components)" if info["heterogeneous"] else "job"
    print(f"submitted {kind} {info['job_id']}: {info['world_size']} ranks")
    print(f"run dir: {info['run_dir']}")
    print(f"logs: {info['train_log']} (rank 0), {info['stderr'][0]} (task 0 stderr)")
    print(f"status: python -m launch.status {info['run_dir']}")
    if not config["launcher"]["wait"]:
        return 0
    return follow(job, info, config["launcher"]["poll_s"])


def choose_custom_task(argv: list[str]) -> None:
    """Your own model or data and no task named: ``task=custom`` goes into ``argv`` (beside the other
    overrides: argparse takes them as one group), with a note on stderr saying why."""
    reason = custom_task_reason(argv[1:])
    if reason is None:
        return
    overrides = overrides_of(argv[1:])
    argv.insert(argv.index(overrides[0], 1), f"task={CUSTOM_TASK}")
    print(
        f"note: task={CUSTOM_TASK} ({reason} and no task named): your reward function "
        "(rollout_worker.reward_fn), LLM-sized lengths and lr; task=<name> keeps a task's defaults",
        file=sys.stderr,
    )


def _shows_config(argv: list[str]) -> bool:
    return any(a in ("--cfg", "-c") for a in argv) and not any(a in ("-m", "--multirun") for a in argv)


def main() -> None:
    catch_signal_early()  # the preemption signal or SIGTERM during start-up: remembered, not fatal
    register_resolvers()
    choose_custom_task(sys.argv)
    try:
        preflight(CONFIG_DIR, CONFIG_NAME, sys.argv[1:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    hydra_main()
    if _shows_config(sys.argv):  # --cfg printed the config unchecked: now say what would stop the run
        try:
            preflight(CONFIG_DIR, CONFIG_NAME, overrides_of(sys.argv[1:]))
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(err.exit_code)


if __name__ == "__main__":
    main()
