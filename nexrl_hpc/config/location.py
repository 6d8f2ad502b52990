"""Where the Hydra config tree is: the checkout's ``configs/`` or the copy an installed wheel ships.

``configs/`` at the top of the repository is the source of every default. A wheel carries a copy of it
as ``nexrl_hpc/configs`` (setup.py's build step), so an installed package runs from any directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONFIG_NAME = "rl_train"
"""The top-level config file (``rl_train.yaml``)."""

_PACKAGE = Path(__file__).resolve().parents[1]


def config_dir() -> str:
    """The config directory: the installed copy if this is a wheel install, else the checkout's."""
    for candidate in (_PACKAGE / "configs", _PACKAGE.parent / "configs"):
        if (candidate / f"{CONFIG_NAME}.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"no Hydra config tree found: neither {_PACKAGE / 'configs'} (an installed wheel) nor "
        f"{_PACKAGE.parent / 'configs'} (a source checkout) holds {CONFIG_NAME}.yaml"
    )


def default_section(dotted: str) -> dict:
    """One section of the shipped defaults (``rl_train.yaml``), e.g. ``runtime.rpc``, for the
    standalone tools that run without a Hydra config (the train service, its workers)."""
    from omegaconf import OmegaConf

    node: Any = OmegaConf.load(Path(config_dir()) / f"{CONFIG_NAME}.yaml")
    for part in dotted.split("."):
        node = node[part]
    return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
