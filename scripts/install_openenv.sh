#!/usr/bin/env bash
# Install OpenEnv into its own cached venv, for rollout_worker.type=openenv and tests/test_openenv_env.py.
# Idempotent; prints the venv's python on the last line.
#   bash scripts/install_openenv.sh                   # venv at $NEXRL_OPENENV_VENV (default below)
#   bash scripts/install_openenv.sh my-env-package    # also pip-install your environment's package(s)
# Why a separate venv: OpenEnv brings ~100 packages (gradio, fastmcp 3 with mcp 1.x, huggingface_hub
# 1.x); the run's environment (and verifiers', which pins mcp 2) must not be pinned to them.
set -euo pipefail
source "$(dirname "$0")/lib/cached_venv.sh"
install_cached_venv "${NEXRL_OPENENV_VENV:-$HOME/.cache/nexrl_hpc/openenv-venv}" \
  "${NEXRL_OPENENV_SPEC:-openenv==0.10.0}" "openenv.core.env_server.http_server, uvicorn" "$@"
