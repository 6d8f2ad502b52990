#!/usr/bin/env bash
# Install nexrl_hpc and everything it needs into the current Python (idempotent).
#   bash scripts/install.sh          # runtime dependencies
#   bash scripts/install.sh --dev    # + test tools, DeepSpeed (engine=deepspeed), vLLM's own venv
#                                    #   (scripts/install_vllm.sh, cached; backend=vllm, tests/test_vllm.py)
#                                    #   verifiers' (scripts/install_verifiers.sh; rollout_worker.type=verifiers)
#                                    #   and OpenEnv's (scripts/install_openenv.sh; rollout_worker.type=openenv)
#   (DeepSpeed alone: DS_BUILD_OPS=0 pip install -e ".[deepspeed]" with torch already installed)
# torch goes in first: an unpinned torch on a machine without one pulls a multi-GB CUDA build.
# On a GPU cluster set NEXRL_TORCH_SPEC to the build you want (e.g. "torch==2.13.0" from the
# CUDA index) or install torch yourself before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "${NEXRL_TORCH_SPEC:-torch==2.13.0}"
fi
# the installed torch is pinned for the rest (deepspeed, in [dev], would otherwise be free to
# replace it); DS_BUILD_OPS=0: DeepSpeed compiles the ops it needs on first use (into
# TORCH_EXTENSIONS_DIR) instead of at install time, which needs no CUDA toolkit
torch_version=$("$PY" -c "import torch; print(torch.__version__)")
DS_BUILD_OPS=0 "$PY" -m pip install --quiet -e ".${extras}" -c <(echo "torch==${torch_version}")
# vLLM (CPU build) in its own venv: it pins a torch and transformers of its own
if [[ -n "$extras" ]]; then bash scripts/install_vllm.sh >/dev/null; fi
# verifiers and OpenEnv in venvs of their own: verifiers pins openai<3 and mcp 2, OpenEnv needs mcp 1
if [[ -n "$extras" ]]; then
  bash scripts/install_verifiers.sh >/dev/null
  bash scripts/install_openenv.sh >/dev/null
fi
