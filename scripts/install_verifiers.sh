#!/usr/bin/env bash
# Install verifiers into its own cached venv, for rollout_worker.type=verifiers and
# tests/test_verifiers_env.py. Idempotent; prints the venv's python on the last line.
#   bash scripts/install_verifiers.sh                  # venv at $NEXRL_VERIFIERS_VENV (default below)
#   bash scripts/install_verifiers.sh my-env-package   # also pip-install your environment's package(s)
# Why a separate venv: verifiers pins openai<3 and brings ~95 packages (mcp, anthropic, prime-*,
# renderers, transformers); the run's environment must not be pinned to them.
set -euo pipefail
source "$(dirname "$0")/lib/cached_venv.sh"
install_cached_venv "${NEXRL_VERIFIERS_VENV:-$HOME/.cache/nexrl_hpc/verifiers-venv}" \
  "${NEXRL_VERIFIERS_SPEC:-verifiers==0.4.0}" "verifiers.v1, renderers" "$@"
