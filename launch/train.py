"""Entry point: ``python -m launch.train [key=value ...]`` (a Hydra app; ``-m`` sweeps).

The config is validated (every problem listed, exit code 2) before anything starts. Exit codes:
0 finished, 1 the run failed (reason printed), 2 bad config, 130 interrupted.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from nexrl_hpc.config import register_resolvers, validate_config
from nexrl_hpc.config.preflight import preflight
from nexrl_hpc.config.validate import ConfigError

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
CONFIG_NAME = "rl_train"

logger = logging.getLogger("launch.train")


def _quiet_third_party() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    for name in ("httpx", "httpx2", "httpcore", "openai", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name=CONFIG_NAME)
def hydra_main(cfg: DictConfig) -> None:
    try:
        config = validate_config(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    _quiet_third_party()
    if config["launch_mode"] == "mpi":
        from hydra.core.hydra_config import HydraConfig

        from nexrl_hpc.runtime.mpi import run_mpi

        code = run_mpi(config, run_controller, HydraConfig.get().runtime.output_dir)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no MPI_Finalize, no waiting on threads of dead peers: exit never hangs
    sys.exit(run_controller(config))


def run_controller(config: dict, runtime: object = None) -> int:
    """Run the controller (rank 0 in mpi mode); the process exit code."""
    from nexrl_hpc.controller import NexRLController, RunFailed

    controller = NexRLController(config, runtime)
    try:
        controller.run()
    except RunFailed as exc:
        logger.error("run failed: %s", exc)
        print(f"error: run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    summary = controller.final_validation()
    print(f"run dir: {controller.run_dir}")
    if summary:
        print("last validation: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(summary.items())))
    return 0


def main() -> None:
    register_resolvers()
    try:
        preflight(CONFIG_DIR, CONFIG_NAME, sys.argv[1:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    hydra_main()


if __name__ == "__main__":
    main()
