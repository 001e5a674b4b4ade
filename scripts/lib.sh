# Shared helpers for the setup scripts (sourced, not executed).
CACHE=${RLJOB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rljob-operator}
LOGDIR="$CACHE/logs"
mkdir -p "$LOGDIR"

# The host Python the cached environments are built with (their keys include its version).
PY=${RLJOB_PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

# ensure_uv: the pinned uv (scripts/versions.env) in the cache; sets UV to its path.
ensure_uv() {
  UV="$CACHE/tools/uv-$UV_VERSION/bin/uv"
  [ -x "$UV" ] && return 0
  rm -rf "$CACHE/tools/uv-$UV_VERSION"
  "$PY" -m pip install --disable-pip-version-check -q --target "$CACHE/tools/uv-$UV_VERSION" "uv==$UV_VERSION"
}

_log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# step "description" command args...
# Runs a step with its output in a log file, prints a progress line every 30 s, and on failure
# names the step, the log, and how to retry.
step() {
  local what=$1; shift
  local log
  log="$LOGDIR/$(echo "$what" | tr -c 'a-zA-Z0-9.\n' '_' | cut -c1-60).log"
  local start=$SECONDS
  _log "start: $what"
  "$@" >"$log" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    local i=0
    while [ $i -lt 30 ] && kill -0 "$pid" 2>/dev/null; do sleep 1; i=$((i + 1)); done
    if kill -0 "$pid" 2>/dev/null; then
      _log "  ... $what: $((SECONDS - start))s elapsed ($(tail -n 1 "$log" | cut -c1-100))"
    fi
  done
  if ! wait "$pid"; then
    _log "FAILED: $what after $((SECONDS - start))s"
    tail -n 25 "$log" >&2
    _log "full log: $log"
    _log "retry: re-run the same command; finished steps are cached in $CACHE and are skipped"
    return 1
  fi
  _log "done: $what ($((SECONDS - start))s)"
}
