#!/usr/bin/env bash
# Fill a folder with the exact pinned wheels that scripts/gpu_evidence.sh installs on a GPU
# machine without network (Python 3.12, manylinux x86_64). Run it where the package registry is
# reachable:
#
#   bash scripts/gpu_wheels.sh [DIR]        # default DIR: wheelhouse/ (git-ignored)
#
# The GPU machine's image already holds torch, Triton, numpy, safetensors, tensorboard, einops,
# tqdm, matplotlib, packaging and pytest; what it lacks, or holds at another version than
# requirements.txt pins, is fetched here, each without its dependencies (--no-deps: the list is
# complete, so pip resolves nothing there):
#   megatron-core  the engine (not in the image)
#   transformers   the image's is older than the pin (Hugging Face export and its tests)
#   tokenizers     likewise (the main job's tokenizer)
#   deepspeed      its cpu_adam op is the baseline of benchmarks/stem_optimizer.py (the runner's
#                  host_optimizer step) and the --stem-optimizer dense kernel; a pure-Python wheel
#                  built here from the sdist (its ops are compiled on first use, like the row
#                  kernels), with its runtime dependencies the image lacks: hjson, msgpack,
#                  psutil, py-cpuinfo, pydantic and pydantic's own (pydantic-core,
#                  annotated-types, typing-inspection, and typing-extensions >= 4.16, newer than
#                  torch needs). ninja is not carried: the image's builds the row kernels
#                  (2026-11-24).
# torch itself is not carried (about 900 MB for a CUDA build); the image's torch is used and its
# version is written into the results. The folder must stay under 60 MiB.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$ROOT/wheelhouse}"
PACKAGES=(megatron-core transformers tokenizers hjson msgpack psutil py-cpuinfo pydantic
          pydantic-core annotated-types typing-inspection typing-extensions)
LIMIT_MIB=60
mkdir -p "$DIR"
PY="${PYTHON:-python3}"
for name in "${PACKAGES[@]}"; do
  pin=$(grep -iE "^${name}==" "$ROOT/requirements.txt" | head -n 1 | sed 's/[[:space:]].*//')
  [ -n "$pin" ] || { echo "gpu_wheels: $name has no pin in requirements.txt" >&2; exit 2; }
  echo "[gpu-wheels] $pin"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 -d "$DIR" "$pin"
done
# DeepSpeed: the version scripts/setup.sh installs, built as a wheel against this checkout's
# virtualenv (its setup.py imports torch; no ops are prebuilt).
DS_PIN=$(grep -oE "deepspeed==[0-9][^ ]*" "$ROOT/scripts/setup.sh" | head -n 1)
[ -n "$DS_PIN" ] || { echo "gpu_wheels: no deepspeed pin in scripts/setup.sh" >&2; exit 2; }
[ -x "$ROOT/.venv/bin/python" ] || { echo "gpu_wheels: run scripts/setup.sh first (deepspeed's wheel builds with its torch)" >&2; exit 2; }
echo "[gpu-wheels] $DS_PIN (built here)"
DS_BUILD_OPS=0 "$ROOT/.venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps \
    --no-build-isolation -w "$DIR" "$DS_PIN" 2>&1 | grep -v "^WARNING: Location" || true
ls "$DIR"/deepspeed-"${DS_PIN#deepspeed==}"-py3-none-any.whl >/dev/null
# One version of each package: a stale wheel of an older pin would stop the install there.
for name in "${PACKAGES[@]}" deepspeed; do
  stem=$(echo "$name" | tr '-' '_')
  if [ "$name" = deepspeed ]; then pin="${DS_PIN#deepspeed==}"; else
  pin=$(grep -iE "^${name}==" "$ROOT/requirements.txt" | head -n 1 | sed 's/.*==//; s/[[:space:]].*//'); fi
  for f in "$DIR"/${stem}-*.whl; do
    case "$(basename "$f")" in "${stem}-${pin}-"*) ;; *) echo "[gpu-wheels] removing stale $(basename "$f")"; rm -f "$f";; esac
  done
done
ls -l "$DIR"/*.whl
total=$(du -cm "$DIR"/*.whl | tail -n 1 | cut -f1)
echo "[gpu-wheels] $(ls "$DIR"/*.whl | wc -l) wheels, ${total} MiB in $DIR"
if [ "$total" -ge "$LIMIT_MIB" ]; then
  echo "gpu_wheels: ${total} MiB is over the ${LIMIT_MIB} MiB limit" >&2; exit 1
fi
