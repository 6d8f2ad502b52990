"""The config of a test that starts vLLM, once vLLM's own venv is there."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.conftest import compose_config


def vllm_config(overrides: list[str]) -> dict[str, Any]:
    """``compose_config(overrides)`` (which names ``backend=vllm``); the test fails naming the
    install command when the venv is missing (the config's own check would refuse it less clearly)."""
    # a base_url skips the config's venv check, so the one here can name the command (the venv
    # alone: with a base_url other checks refuse what the test's overrides ask for, e.g. LoRA)
    raw = compose_config(
        ["service.inference_service.backend=vllm", "service.inference_service.base_url=http://unused"]
    )
    python = raw["service"]["inference_service"]["vllm"]["python"]
    if not os.access(python, os.X_OK):
        pytest.fail(f"vLLM's venv is missing ({python}): run `bash scripts/install_vllm.sh`")
    return compose_config(overrides)
