# Sourced by scripts/install_{vllm,verifiers,openenv}.sh: install_cached_venv VENV SPEC IMPORTS [PACKAGE ...]
# Installs SPEC (and the user's packages) into VENV, runs the caller's `after_install` if it defined
# one, checks that `import IMPORTS` works, and prints the venv's python on the last line. Idempotent:
# a marker file holding SPEC is written last; when it is there and matches, only the given packages
# are installed.
install_cached_venv() {
  local venv=$1 spec=$2 imports=$3
  shift 3
  local py=${PYTHON:-python3}
  local marker="$venv/.nexrl_installed"
  if [[ -f "$marker" && "$(cat "$marker")" == "$spec" && -x "$venv/bin/python" ]]; then
    if [[ $# -gt 0 ]]; then "$venv/bin/python" -m pip install --quiet "$@" >&2; fi
    echo "$venv/bin/python"
    return 0
  fi
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  rm -f "$marker"
  mkdir -p "$(dirname "$venv")"
  [[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet "$spec" "$@" >&2
  if declare -F after_install >/dev/null; then after_install "$venv"; fi
  # fail here, not in the first run, if the install is unusable
  "$venv/bin/python" -c "import $imports" >&2
  echo "$spec" >"$marker"
  echo "$venv/bin/python"
}
