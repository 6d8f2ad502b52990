"""Resolve ``"package.module:attribute"`` strings from the config."""

from __future__ import annotations

import importlib
from typing import Any


def load_object(spec: str) -> Any:
    """Import ``module:attr`` (``attr`` may be dotted). Raises ImportError/AttributeError with the spec."""
    if ":" not in spec:
        raise ImportError(f"{spec!r} is not of the form 'package.module:name'")
    module_name, _, attr_path = spec.partition(":")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj
