#!/usr/bin/env bash
# Create .venv (Python 3.12) and install the pinned dependencies and the package (editable).
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python312() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  local v
  if command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -1 || true)
    if [ -n "$v" ]; then echo "$(pyenv root)/versions/$v/bin/python3.12"; return; fi
  fi
  for p in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
    [ -x "$p" ] && { echo "$p"; return; }
  done
  if command -v python3.12 >/dev/null 2>&1; then command -v python3.12; return; fi
  echo "megatron-ext needs Python 3.12 (megatron-core 0.19 requires it); set PYTHON=/path/to/python3.12" >&2
  exit 1
}

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  PY=$(find_python312)
  echo "[setup] creating .venv with $PY"
  rm -rf .venv
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
# pip install ARGS with pip's "WARNING: Location" lines filtered out. The exit status is pip's:
# grep exits 1 when it passes no line (pip -q usually prints none), so its status is discarded and
# pipefail hands on pip's; a failed install stops the setup here, pip's own error printed above.
pip_install() {
  local status=0
  "${PIP[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; } || status=$?
  if [ "$status" -ne 0 ]; then
    echo "[setup] failed: pip install $* (exit $status; pip's error is above)" >&2
    exit "$status"
  fi
}
echo "[setup] installing pinned requirements (the first time downloads torch, a few minutes)"
pip_install -r requirements.txt
.venv/bin/python -c 'import torch, megatron.core' >/dev/null
if ! .venv/bin/python -c 'import deepspeed' >/dev/null 2>&1; then
  echo "[setup] installing deepspeed (built against the installed torch)"
  pip_install --no-build-isolation deepspeed==0.19.8
fi
pip_install --no-deps --no-build-isolation -e .
# The kernels' folder is kernels/, imported as megatron_ext_kernels: only the install's mapping
# (setup.py's package_dir) makes that name importable, the checkout's folder alone does not.
.venv/bin/python -c 'import megatron_ext_kernels' >/dev/null 2>&1 || {
  echo "[setup] failed: import megatron_ext_kernels after pip install -e . (setup.py's package_dir maps it to kernels/)" >&2
  exit 1; }
.venv/bin/python -c 'import megatron_ext, deepspeed, tokenizers, megatron.training' >/dev/null 2>&1
echo "[setup] ok: $(.venv/bin/python -c 'import torch, megatron.core as m; print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "megatron-core", m.__version__)')"
