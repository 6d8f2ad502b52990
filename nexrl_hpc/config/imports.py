"""Resolve ``"package.module:attribute"`` and ``"path/to/file.py:attribute"`` strings from the config."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

FILE_MODULE_PREFIX = "nexrl_file_"
"""The module name of a ``file.py:name`` import starts with this (then the file's stem and a hash)."""


def _import_file(path: str) -> ModuleType:
    """Import a ``.py`` file by path (relative to the current directory, or absolute), once per file.

    Why a name derived from the absolute path: two files both called ``reward.py`` stay two modules,
    and the same file loaded twice (config check, then the worker) is one module.
    """
    full = os.path.abspath(path)
    stem = os.path.splitext(os.path.basename(full))[0]
    name = f"{FILE_MODULE_PREFIX}{stem}_{hashlib.sha1(full.encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(full):
        raise ImportError(f"no such file {path!r} (resolved to {full})")
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_object(spec: str) -> Any:
    """Import ``module:attr`` or ``file.py:attr`` (``attr`` may be dotted).

    Raises ImportError/AttributeError naming the spec."""
    if ":" not in spec:
        raise ImportError(f"{spec!r} is not of the form 'package.module:name' or 'path/to/file.py:name'")
    module_name, _, attr_path = spec.rpartition(":")
    if module_name.endswith(".py"):
        module = _import_file(module_name)
    else:
        module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj
