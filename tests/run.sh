#!/usr/bin/env bash
# The README's test command: set up .venv (with test extras), then ruff and
# every test that needs no GPU. Docker/compose tests need a running engine
# (deploy/docker/install-engine.sh); ROLLOUT_SIDECAR_REQUIRE_DOCKER=1 turns
# their skip into a failure, which CI sets.
#
#   bash tests/run.sh            everything but `gpu` (CI runs this)
#   bash tests/run.sh --fast     the inner loop: no engine, no server,
#                                no Docker (-m "not e2e"), about a minute
#
# Other arguments go to pytest (e.g. -k, -x, a path).
set -euo pipefail
cd "$(dirname "$0")/.."
markers="not gpu"
if [[ "${1:-}" == "--fast" ]]; then
  markers="not gpu and not e2e"
  shift
fi
# A full run builds the compose test's images (tests/compose/image_build.py):
# started now, beside setup's pip install (one core, minutes on a fresh
# machine); the session adopts it through ROLLOUT_SIDECAR_IMAGE_BUILD_DIR.
if [[ $# -eq 0 && "$markers" == "not gpu" ]] && docker info >/dev/null 2>&1; then
  build_dir=$(mktemp -d -t rollout-sidecar-images-XXXXXX)
  export ROLLOUT_SIDECAR_IMAGE_BUILD_DIR=$build_dir
  setsid bash -c 'echo $$ > "$1/pid.tmp" && mv "$1/pid.tmp" "$1/pid"
                  bash deploy/docker/build.sh > "$1/build.log" 2>&1; echo $? > "$1/rc"' \
    _ "$build_dir" < /dev/null &
  build_pid=$!
  trap 'kill -- -"$build_pid" 2>/dev/null' EXIT  # setup or ruff failed: no pytest to adopt it
fi
bash deploy/setup.sh --test
.venv/bin/ruff check .
trap - EXIT
exec .venv/bin/python -m pytest -m "$markers" "$@"
