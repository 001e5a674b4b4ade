#!/usr/bin/env bash
# Builds the docs site strictly (mkdocs-material): a warning, a dead internal link, a missing anchor or
# a page left out of the nav fails. The tools live in their own small venv in the cache, keyed by
# requirements/docs.lock. The API reference (docs/reference/) is generated from crds/rljob.yaml and
# checked for staleness first.
#   scripts/build_docs.sh           build into site/ (open site/index.html)
#   scripts/build_docs.sh serve     live preview on 127.0.0.1:8000
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
source "$here/versions.env"
source "$here/lib.sh"
key=$( (cat "$repo/requirements/docs.lock"; "$PY" --version) | sha256sum | cut -c1-16)
DOCS="$CACHE/docs-venv-$key"
ensure_uv
if [ ! -f "$DOCS/.complete" ]; then
  rm -rf "$DOCS"
  step "docs tools (mkdocs-material)" bash -c "'$UV' venv --python '$PY' '$DOCS' && '$UV' pip install --python '$DOCS/bin/python' -r '$repo/requirements/docs.lock'"
  touch "$DOCS/.complete"
fi
cd "$repo"
"$DOCS/bin/python" scripts/gen_api_reference.py --check
if [ "${1:-build}" = serve ]; then
  NO_MKDOCS_2_WARNING=1 exec "$DOCS/bin/mkdocs" serve -a 127.0.0.1:8000
fi
NO_MKDOCS_2_WARNING=1 "$DOCS/bin/mkdocs" build --strict --clean
echo "[docs] site built strictly: $repo/site/index.html"
