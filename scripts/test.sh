#!/usr/bin/env bash
# Install everything the tests need (idempotent), then run the whole test suite.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -k config
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --dev
exec "${PYTHON:-python3}" -m pytest -q -ra "$@"
