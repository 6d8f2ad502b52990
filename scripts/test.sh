#!/usr/bin/env bash
# Install everything the tests need (idempotent), then run the whole test suite.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -k config
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --dev
# the Slurm dev cluster's Debian packages (tests start the cluster itself: slurm/dev/start.sh)
if [[ $(id -u) -eq 0 ]] || command -v sudo >/dev/null; then bash slurm/dev/install.sh; fi
# static checks first (seconds): types (mypy, configured in pyproject.toml) and style
"${PYTHON:-python3}" -m mypy
"${PYTHON:-python3}" -m ruff check .
"${PYTHON:-python3}" -m ruff format --check .
exec "${PYTHON:-python3}" -m pytest -q -ra --durations=15 "$@"
