#!/usr/bin/env bash
# The GPU half of the checks, for a machine with an NVIDIA GPU whose python3 has torch, triton,
# transformers and the engine's few packages (gguf, tokenizers, jinja2); CI has no GPU and skips
# these tests. No Django is needed: pytest stops looking for conftest files at tests/engine.
#
#   scripts/gpu-checks.sh tests [pytest args]   the engine's tests (the CUDA ones run here), or
#                                               the test files the arguments name
#   scripts/gpu-checks.sh kernels [args]        bench/kernels.py  → bench/results/kernels-<gpu>.json
#   scripts/gpu-checks.sh engine [args]         bench/engine.py   → bench/results/engine-<gpu>.json
#   scripts/gpu-checks.sh embeddings [args]     bench/embeddings.py → bench/results/embeddings-<gpu>.json
#
# Logs go to $LOG_DIR (default bench/results/logs), one file per step.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
step=${1:-}
[ -n "$step" ] && shift
case "$step" in
  -h|--help) usage; exit 0 ;;
  tests|kernels|engine|embeddings) ;;
  *) usage >&2; exit 2 ;;
esac

python=${PYTHON:-python3}
if ! "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA device visible to $python (torch.cuda.is_available() is False)" >&2
  exit 2
fi
log_dir=${LOG_DIR:-bench/results/logs}
mkdir -p "$log_dir"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

case "$step" in
  tests)
    paths=(tests/engine)  # unless the arguments name test files or folders of their own
    for arg in "$@"; do [[ $arg == tests/* ]] && paths=(); done
    "$python" -m pytest "${paths[@]}" --confcutdir=tests/engine -p no:django \
      -p no:cacheprovider -o addopts="" --import-mode=importlib -ra "$@" 2>&1 \
      | tee "$log_dir/tests.log" ;;
  kernels)
    "$python" bench/kernels.py "$@" 2>&1 | tee "$log_dir/kernels.log" ;;
  engine)
    "$python" bench/engine.py --device cuda "$@" 2>&1 | tee "$log_dir/engine.log" ;;
  embeddings)
    "$python" bench/embeddings.py --device cuda --texts 512 "$@" 2>&1 | tee "$log_dir/embeddings.log" ;;
esac
