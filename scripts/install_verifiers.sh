#!/usr/bin/env bash
# Install verifiers into its own cached venv, for rollout_worker.type=verifiers and
# tests/test_verifiers_env.py. Idempotent: a marker file holding the pinned spec is written last; when
# it is there and matches, nothing is done. Prints the venv's python on the last line.
#   bash scripts/install_verifiers.sh                  # venv at $NEXRL_VERIFIERS_VENV (default below)
#   bash scripts/install_verifiers.sh my-env-package   # also pip-install your environment's package(s)
# Why a separate venv: verifiers pins openai<3 and brings ~95 packages (mcp, anthropic, prime-*,
# renderers, transformers); the run's environment must not be pinned to them.
set -euo pipefail
VENV=${NEXRL_VERIFIERS_VENV:-$HOME/.cache/nexrl_hpc/verifiers-venv}
SPEC=${NEXRL_VERIFIERS_SPEC:-verifiers==0.4.0}
PY=${PYTHON:-python3}
MARKER="$VENV/.nexrl_verifiers_installed"
if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$SPEC" && -x "$VENV/bin/python" ]]; then
  if [[ $# -gt 0 ]]; then "$VENV/bin/python" -m pip install --quiet "$@" >&2; fi
  echo "$VENV/bin/python"
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
rm -f "$MARKER"
mkdir -p "$(dirname "$VENV")"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "$SPEC" "$@" >&2
# fail here, not in the first run, if the install is unusable
"$VENV/bin/python" -c "import verifiers.v1, renderers" >&2
echo "$SPEC" >"$MARKER"
echo "$VENV/bin/python"
