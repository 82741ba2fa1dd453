#!/usr/bin/env bash
# Every GPU number of the project from one command, on a machine with one NVIDIA GPU, Python 3.12
# with torch and Triton, and no network:
#
#   bash scripts/gpu_evidence.sh RESULTS_DIR [--wheels DIR] [--steps a,b | --call N]
#       [--skip a,b] [--budget-min 9] [--bundle DIR] [--print-only] [--check-commands]
#
# 1. installs the pinned packages the machine lacks from a folder of wheels (default: wheelhouse/,
#    filled by scripts/gpu_wheels.sh on a machine with the package registry), without the network,
#    into RESULTS_DIR/.site, and names any package still missing;
# 2. runs the plan of scripts/gpu_evidence.py (GPU tests, every GPU benchmark, the 350M scaling
#    runs), each step under its own time limit, a failure recorded rather than fatal;
# 3. writes RESULTS_DIR/evidence.json and RESULTS_DIR/evidence.md (every ratio against its goal),
#    then exits 1 if a step failed, crashed, timed out or left a goal without its number.
# --print-only prints the plan (every command with its limit, and the next GPU session's calls,
# docs/gpu_session.md) and runs nothing; --call N runs that session's call N; --bundle DIR keeps
# DIR (a device call's $OUT) a copy of the results that a call killed at its timeout still
# brings back.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }
[ $# -ge 1 ] || { usage >&2; exit 2; }
case "$1" in -h|--help) usage; exit 0;; -*) echo "gpu_evidence: the first argument is the results folder" >&2; exit 2;; esac
RESULTS="$1"; shift
WHEELS="$ROOT/wheelhouse"
PASS=(); PLAN_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2;;
    --print-only|--check-commands) PLAN_ONLY=1; PASS+=("$1"); shift;;
    *) PASS+=("$1"); shift;;
  esac
done

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"
else PY="$(command -v python3)"; fi
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' 2>/dev/null || {
  echo "gpu_evidence: $PY is not Python 3.12 (megatron-core 0.19 needs it); set PYTHON=" >&2; exit 2; }

if [ "$PLAN_ONLY" = 1 ]; then
  exec "$PY" scripts/gpu_evidence.py "$RESULTS" --python "$PY" "${PASS[@]}"
fi

mkdir -p "$RESULTS"
SITE="$(cd "$RESULTS" && pwd)/.site"
mkdir -p "$SITE"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  # A second call on the same machine (the next GPU session's call 2) finds them installed:
  # the wheels' names and sizes, written after an install that ended, say which.
  STAMP="$(cd "$WHEELS" && ls -l -- *.whl | awk '{print $5, $NF}')"
  if [ -f "$SITE/.wheels" ] && [ "$(cat "$SITE/.wheels")" = "$STAMP" ]; then
    echo "[gpu-evidence] the $(ls "$WHEELS"/*.whl | wc -l) wheels of $WHEELS are installed in $SITE"
  else
    echo "[gpu-evidence] installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS (no network) into $SITE"
    rm -f "$SITE/.wheels"
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
    printf '%s' "$STAMP" > "$SITE/.wheels"
  fi
else
  echo "[gpu-evidence] no wheels in $WHEELS: using what the machine has"
fi
# The project itself (megatron_ext, and kernels/ under its import name megatron_ext_kernels, as
# setup.py's package_dir maps it), linked so that the results are those of this checkout.
ln -sfn "$ROOT/megatron_ext" "$SITE/megatron_ext"
ln -sfn "$ROOT/kernels" "$SITE/megatron_ext_kernels"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# Every package a step imports; a missing one is named with the pin to fetch.
"$PY" - "$WHEELS" <<'PYEOF'
import importlib, re, sys
pins = {}
for line in open("requirements.txt"):
    m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", line)
    if m:
        pins[m.group(1).lower()] = m.group(2)
need = [("torch", "torch"), ("triton", "triton"), ("numpy", "numpy"),
        ("megatron.core", "megatron-core"), ("megatron.training", "megatron-core"),
        ("transformers", "transformers"), ("tokenizers", "tokenizers"),
        ("safetensors", "safetensors"), ("tensorboard", "tensorboard"), ("einops", "einops"),
        ("tqdm", "tqdm"), ("matplotlib", "matplotlib"), ("pytest", "pytest"),
        ("megatron_ext", None), ("megatron_ext_kernels", None)]
missing = []
for mod, dist in need:
    try:
        importlib.import_module(mod)
    except Exception as e:
        pin = f"{dist}=={pins[dist]}" if dist in pins else (dist or "this checkout")
        missing.append(f"  {pin}: import {mod} failed ({type(e).__name__}: {e})")
try:  # only the host_optimizer step needs it: named, not fatal
    importlib.import_module("deepspeed")
except Exception as e:
    print(f"[gpu-evidence] deepspeed is missing ({type(e).__name__}: {e}): the host_optimizer "
          "step will fail; scripts/gpu_wheels.sh carries it", file=sys.stderr)
if missing:
    print("[gpu-evidence] missing packages (put their wheels in " + sys.argv[1] +
          "; scripts/gpu_wheels.sh fetches them on a machine with the registry):\n" +
          "\n".join(missing), file=sys.stderr)
    sys.exit(2)
from importlib.metadata import version
off = [f"{d} {version(d)} (pinned {pins[d]})" for d in ("megatron-core", "transformers",
       "tokenizers", "numpy", "torch") if d in pins and version(d) != pins[d]]
if off:
    print("[gpu-evidence] versions that differ from requirements.txt: " + ", ".join(off))
PYEOF

exec "$PY" scripts/gpu_evidence.py "$RESULTS" --python "$PY" "${PASS[@]}"
