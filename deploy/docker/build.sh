#!/usr/bin/env bash
# build.sh: build rollout-sidecar/server:dev and rollout-sidecar/trainer:dev
# offline, on a host with no Docker Hub and no BuildKit.
#
# Why: the one command CI and developers run before `docker compose up`. It
#   1. starts the engine (install-engine.sh) if `docker info` does not answer,
#   2. makes the Docker-Hub-free base image (make-base-image.sh; skipped if
#      it exists),
#   3. refreshes the wheelhouse (make-wheelhouse.sh; the project wheel is
#      rebuilt from the working tree, the dependencies are downloaded once),
#   4. builds both targets of deploy/Dockerfile with the classic builder,
#      BASE_IMAGE=rollout-sidecar/base:bookworm and the wheelhouse.
# Re-runs hit Docker's layer cache: a code change rebuilds only the project
# layer. Quiet unless failing (the build logs are shown on failure).
#
# Env knobs:
#   BASE_IMAGE      base image          [rollout-sidecar/base:bookworm, built here]
#   SERVER_IMAGE    server tag          [rollout-sidecar/server:dev]
#   TRAINER_IMAGE   trainer tag         [rollout-sidecar/trainer:dev]
#   VLLM_EXTRA      cpu | gpu           [cpu] (gpu needs the network: see Dockerfile)
#   APT_PACKAGES    extra OS packages for the base stage []
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEPLOY=$(dirname "$HERE")
DEFAULT_BASE=rollout-sidecar/base:bookworm
BASE_IMAGE=${BASE_IMAGE:-$DEFAULT_BASE}
SERVER_IMAGE=${SERVER_IMAGE:-rollout-sidecar/server:dev}
TRAINER_IMAGE=${TRAINER_IMAGE:-rollout-sidecar/trainer:dev}
VLLM_EXTRA=${VLLM_EXTRA:-cpu}
APT_PACKAGES=${APT_PACKAGES:-}

log() { echo "build: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

if ! docker info >/dev/null 2>&1; then
    bash "$HERE/install-engine.sh" >/dev/null
fi
if [ "$BASE_IMAGE" = "$DEFAULT_BASE" ]; then
    BASE_IMAGE_TAG=$DEFAULT_BASE bash "$HERE/make-base-image.sh"
fi
bash "$HERE/make-wheelhouse.sh"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
build() {  # build TARGET TAG
    local target=$1 tag=$2
    if ! DOCKER_BUILDKIT=0 docker build \
        --target "$target" --tag "$tag" \
        --build-arg BASE_IMAGE="$BASE_IMAGE" \
        --build-arg WHEELHOUSE=.wheelhouse \
        --build-arg VLLM_EXTRA="$VLLM_EXTRA" \
        --build-arg APT_PACKAGES="$APT_PACKAGES" \
        --file "$DEPLOY/Dockerfile" "$DEPLOY" >"$tmp/$target.log" 2>&1; then
        tail -n 60 "$tmp/$target.log" >&2
        die "building $tag (target $target) failed"
    fi
}
build server "$SERVER_IMAGE"
# Shares every layer up to `runtime` with the server: only metadata is new.
build trainer "$TRAINER_IMAGE"
