#!/usr/bin/env bash
# make-wheelhouse.sh: fill deploy/.wheelhouse/ (gitignored) with every wheel
# the images install, so `docker build` needs no network at all.
#
#   deploy/.wheelhouse/project/  the rollout-sidecar wheel (rebuilt each run
#                                from the working tree; replaced only when
#                                its content changed, so Docker's layer cache
#                                holds)
#   deploy/.wheelhouse/deps/     all third-party wheels for Linux x86_64
#                                CPython 3.11 (the `cpu` and `demo` extras,
#                                torch 2.13.0+cpu from pip's find-links), plus
#                                requirements-cpu.lock; see wheelhouse.py
#
# Why: builds run with the classic builder and no Docker Hub; installing from
# a host-side wheelhouse (`pip install --no-index`) makes them offline,
# repeatable and fast. Wheels already present are not downloaded again, and
# the resolution is reused while pyproject.toml's requirements are unchanged
# (REFRESH=1 re-resolves). Quiet unless failing.
#
# Env knobs:
#   PYTHON      a CPython 3.11 on Linux x86_64 to resolve with [python3]
#   WHEELHOUSE  output directory                               [deploy/.wheelhouse]
#   REFRESH=1   re-resolve the dependencies against the indexes
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEPLOY=$(dirname "$HERE")
REPO=$(dirname "$DEPLOY")
WHEELHOUSE=${WHEELHOUSE:-$DEPLOY/.wheelhouse}
PYTHON=${PYTHON:-python3}

log() { echo "make-wheelhouse: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
    || die "$PYTHON is not CPython 3.11 (the images' Python); set PYTHON=/path/to/python3.11"

mkdir -p "$WHEELHOUSE/project" "$WHEELHOUSE/deps"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# --- 1. the project wheel ----------------------------------------------------
# Built from a copy of the sources, so setuptools' build/ and egg-info never
# land in the working tree. Files: what git tracks or would track (untracked
# but not ignored), so the wheel is what a fresh clone would build.
mkdir -p "$tmp/src" "$tmp/wheel"
if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
        | grep -zv '^deploy/\|^tests/\|^helm/' \
        | tar --null --no-recursion -T - -cf -) | tar -C "$tmp/src" -xf -
else
    tar -C "$REPO" --exclude=./deploy --exclude=./tests --exclude=./helm --exclude=./.git \
        --exclude=./build --exclude='*.egg-info' -cf - . | tar -C "$tmp/src" -xf -
fi
[ -f "$tmp/src/pyproject.toml" ] || die "no pyproject.toml under $REPO"
# Fixed timestamps: the same sources give the same wheel bytes.
SOURCE_DATE_EPOCH=315532800 "$PYTHON" -m pip wheel --no-deps --quiet \
    --wheel-dir "$tmp/wheel" "$tmp/src" >"$tmp/pip.log" 2>&1 \
    || { cat "$tmp/pip.log" >&2; die "building the project wheel failed"; }
new=$(ls "$tmp/wheel"/*.whl)
old="$WHEELHOUSE/project/$(basename "$new")"
if ! cmp -s "$new" "$old"; then
    rm -f "$WHEELHOUSE/project"/*.whl
    mv "$new" "$WHEELHOUSE/project/"
fi

# --- 2. the dependencies -----------------------------------------------------
"$PYTHON" "$HERE/wheelhouse.py" "$old" "$tmp/src/pyproject.toml" "$WHEELHOUSE/deps" \
    ${REFRESH:+--refresh}
