#!/usr/bin/env bash
# Install (idempotent), then run the embedded default: GRPO on the tiny local model, CPU, nothing downloaded.
# Extra arguments are Hydra overrides, e.g.  bash scripts/run.sh run_dir=/tmp/x seed=3
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" -m launch.train "$@"
