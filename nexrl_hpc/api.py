"""``nexrl_hpc.train(...)``: the same run as ``python -m launch.train``, from a script or notebook.

Python objects become config overrides: datasets (rows, a ``datasets.Dataset``, or file paths) are
named by ``data.data_files``, rows written as jsonl under ``<run_dir>/inputs/`` (removed again, with
the folders this call made, when the config check fails), the data type told by the files'
extensions; a dataset of your own means ``task=custom`` unless the overrides name a task
(``nexrl_hpc.config.task_choice``); a reward function
or workflow class is named by its import path (``module:qualname``), or, when it has none (defined
in ``__main__`` or inside a function), registered here for this process. The composed config goes
through the command line's checks (exit-2 problems raise ``ConfigError``) and then the controller,
in local mode. A run named by a registered object cannot be resumed from the command line: its
``config.yaml`` points into this process.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from nexrl_hpc.assembly import validate_config
from nexrl_hpc.config import register_resolvers
from nexrl_hpc.config.location import CONFIG_NAME, config_dir
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.config.task_choice import with_task_choice
from nexrl_hpc.config.validate import ConfigError, ConfigProblem

registered = SimpleNamespace()
"""Objects handed to ``train`` that have no import path; the config names them ``nexrl_hpc.api:registered.<name>``."""

Dataset = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Iterable[Mapping[str, Any]]


@dataclass
class TrainResult:
    """How a ``train`` call ended: the exit code the command line would give, and where to look."""

    exit_code: int  # 0 finished, 1 failed, 3 stopped at a checkpoint (preempted), 130 interrupted
    run_dir: str
    final_validation: dict[str, float] = field(default_factory=dict)  # the last val/* metrics

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.run_dir, "metrics.jsonl")

    def metrics(self) -> list[dict[str, Any]]:
        """Every line of ``metrics.jsonl`` (one per training step and validation)."""
        with open(self.metrics_path) as f:
            return [json.loads(line) for line in f if line.strip()]


def object_spec(obj: Any, name: str) -> str:
    """``module:qualname`` when that imports back to ``obj``; else a registered name."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if module and qualname and module != "__main__" and "<locals>" not in qualname:
        try:
            found: Any = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
        if found is obj:
            return f"{module}:{qualname}"
    setattr(registered, name, obj)
    return f"{__name__}:registered.{name}"


def _quoted(path: str) -> str:
    """A path as a Hydra override value (quoted: commas, brackets, spaces, '=' are syntax)."""
    return "'" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"


_DATA_TYPES_BY_EXTENSION = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}
"""``data.type`` of a dataset handed as file paths, by extension (``.json``: JSON lines)."""


def _dataset_files(dataset: Dataset, out_path: str, key: str, written: list[str]) -> list[str]:
    """File paths as given; rows (mappings, a ``datasets.Dataset``) written as jsonl to ``out_path``
    (appended to ``written`` before a byte is written: a failed call removes it)."""
    if isinstance(dataset, (str, os.PathLike)):
        return [os.fspath(dataset)]
    if isinstance(dataset, Sequence) and dataset and all(isinstance(d, (str, os.PathLike)) for d in dataset):
        return [os.fspath(d) for d in dataset]
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    written.append(out_path)
    count = 0
    with open(out_path, "w") as f:
        for i, row in enumerate(dataset):
            if not isinstance(row, Mapping):
                raise ConfigError([ConfigProblem(key, f"row {i} is a {type(row).__name__}, not a mapping")])
            try:
                f.write(json.dumps(dict(row)) + "\n")
            except TypeError as exc:
                raise ConfigError([ConfigProblem(key, f"row {i} cannot be written as JSON: {exc}")]) from exc
            count += 1
    if count == 0:
        raise ConfigError([ConfigProblem(key, "the dataset has no rows")])
    return [out_path]


def data_type_of(files: Sequence[str], key: str) -> str:
    """The ``data.type`` that reads ``files`` (``.parquet``; ``.jsonl`` / ``.json``: JSON lines); a
    ``ConfigError`` naming ``key`` for another extension, a folder, or a mix of types."""
    types = set()
    for path in files:
        extension = os.path.splitext(path)[1].lower()
        if extension not in _DATA_TYPES_BY_EXTENSION:
            raise ConfigError(
                [
                    ConfigProblem(
                        key,
                        f"{path!r}: cannot tell the data type from its extension "
                        f"({extension or 'none'}; known: .parquet, .jsonl, .json): name it in the overrides, "
                        "e.g. data.type=hf for a datasets folder or another file type",
                    )
                ]
            )
        types.add(_DATA_TYPES_BY_EXTENSION[extension])
    if len(types) > 1:
        raise ConfigError(
            [ConfigProblem(key, f"files of different types ({', '.join(sorted(types))}): {list(files)}")]
        )
    return types.pop()


def _missing_dirs(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while path and not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _remove_created(files: list[str], dirs: list[str]) -> None:
    """Undo what a failed ``train`` call wrote: its row files, then the folders it made, if empty."""
    for path in files:
        if os.path.exists(path):
            os.remove(path)
    for path in dirs:  # deepest first
        try:
            os.rmdir(path)
        except OSError:  # not empty (something else wrote there) or already gone
            pass


def _compose(overrides: list[str]) -> RLTrainConfig:
    """The validated config for ``overrides``, after the same checks ``launch.train`` makes."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from nexrl_hpc.launcher.preflight import preflight

    register_resolvers()
    preflight(config_dir(), CONFIG_NAME, overrides)  # raises ConfigError listing every problem
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="nexrl_api"):
        cfg = compose(CONFIG_NAME, overrides=overrides)
    GlobalHydra.instance().clear()
    return validate_config(cfg)


def train(
    overrides: Sequence[str] = (),
    *,
    train_dataset: Dataset | None = None,
    val_dataset: Dataset | None = None,
    reward_fn: Any = None,
    workflow: Any = None,
    run_dir: str | os.PathLike[str] | None = None,
) -> TrainResult:
    """Run GRPO training in this process (local mode) and return how it ended.

    ``overrides`` are command-line overrides (``["model.path=/m", "data.batch_size=8"]``).
    ``train_dataset`` / ``val_dataset``: file paths (``.parquet``, ``.jsonl`` / ``.json`` as JSON
    lines; any other: set ``data.type`` in ``overrides``) or rows (mappings with the configured
    prompt/answer keys). ``reward_fn``: any accepted reward signature (TRL's
    ``reward_func(completions, **kwargs)``, verl's ``compute_score``, ``(task, response)``, a
    RewardOutput function), or a list of them (TRL's ``reward_funcs``; weights: the
    ``rollout_worker.reward_weights`` override).
    ``workflow``: an agent workflow class (sets ``rollout_worker.type=agent``). Raises
    ``ConfigError`` for a bad config, before anything runs.
    """
    own_data = "train_dataset given" if train_dataset is not None else None
    args = with_task_choice(overrides, own_data)  # your own data: task=custom unless a task is named
    if run_dir is not None:
        args.append(f"run_dir={_quoted(os.path.abspath(os.fspath(run_dir)))}")
    resolved_run_dir = _run_dir_of(args)  # once: its default holds the time of day
    args.append(f"run_dir={_quoted(resolved_run_dir)}")
    inputs = os.path.join(resolved_run_dir, "inputs")
    written: list[str] = []
    new_dirs = _missing_dirs(inputs)
    try:
        args += _dataset_args(overrides, train_dataset, val_dataset, inputs, written)
        args += _reward_args(reward_fn)
        if workflow is not None:
            args.append("rollout_worker.type=agent")
            args.append(f"rollout_worker.agent.workflow={_quoted(object_spec(workflow, 'workflow'))}")
        config = _compose(args)
        if config["launch_mode"] != "local" or config["launcher"]["name"] != "local":
            raise ConfigError(
                [
                    ConfigProblem(
                        "launch_mode",
                        "the Python API runs local mode: use python -m launch.train for mpi/slurm",
                    )
                ]
            )
    except ConfigError:
        _remove_created(written, new_dirs)
        raise
    return _run(config)


def _dataset_args(
    overrides: Sequence[str],
    train_dataset: Dataset | None,
    val_dataset: Dataset | None,
    inputs: str,
    written: list[str],
) -> list[str]:
    """The overrides naming the datasets: their files (rows written under ``inputs``) and, unless the
    overrides set it, the data type their files' extensions tell."""
    given = {a.split("=")[0].lstrip("+~") for a in overrides}
    args = []
    train_type = None
    if train_dataset is not None:
        files = _dataset_files(train_dataset, os.path.join(inputs, "train.jsonl"), "train_dataset", written)
        if "data.type" not in given:
            train_type = data_type_of(files, "train_dataset")
            args.append(f"data.type={train_type}")
        args.append("data.data_files=[" + ",".join(_quoted(f) for f in files) + "]")
    if val_dataset is not None:
        files = _dataset_files(val_dataset, os.path.join(inputs, "validation.jsonl"), "val_dataset", written)
        if not given & {"data.type", "validate.data.type"}:
            val_type = data_type_of(files, "val_dataset")
            if val_type != train_type:  # validate.data.type follows data.type unless set
                args.append(f"validate.data.type={val_type}")
        args.append("validate.data.data_files=[" + ",".join(_quoted(f) for f in files) + "]")
    return args


def _reward_args(reward_fn: Any) -> list[str]:
    """The ``rollout_worker.reward_fn`` override naming ``reward_fn``: one function, or several
    (TRL's reward_funcs; their weights are ``rollout_worker.reward_weights``)."""
    if isinstance(reward_fn, (list, tuple)):
        specs = [_quoted(object_spec(fn, f"reward_fn_{i}")) for i, fn in enumerate(reward_fn)]
        return [f"rollout_worker.reward_fn=[{','.join(specs)}]"]
    if reward_fn is not None:
        return [f"rollout_worker.reward_fn={_quoted(object_spec(reward_fn, 'reward_fn'))}"]
    return []


def _run_dir_of(overrides: list[str]) -> str:
    """The run dir ``overrides`` give (composed, not yet checked: the datasets are not in them yet).
    Overrides Hydra cannot compose are reported by the full check."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="nexrl_api"):
            cfg = compose(CONFIG_NAME, overrides=overrides)
        return os.path.abspath(str(OmegaConf.select(cfg, "run_dir")))
    except HydraException:
        _compose(overrides)  # raises ConfigError naming every problem
        raise
    finally:
        GlobalHydra.instance().clear()


def _run(config: RLTrainConfig) -> TrainResult:
    from nexrl_hpc.controller import run_controller
    from nexrl_hpc.runtime.run_files import restrict_run_files

    run_dir = os.path.abspath(config["run_dir"])
    os.makedirs(run_dir, exist_ok=True)
    restrict_run_files(config)  # runtime.umask before train.log is created
    root = logging.getLogger()
    handler = logging.FileHandler(os.path.join(run_dir, "train.log"))
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    level = root.level
    root.addHandler(handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    try:
        code = run_controller(config)
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(level)
    result = TrainResult(code, run_dir)
    if os.path.exists(result.metrics_path):
        val = [row for row in result.metrics() if any(k.startswith("val/") for k in row)]
        if val:
            result.final_validation = {k: v for k, v in val[-1].items() if k.startswith("val/")}
    return result
