#!/usr/bin/env bash
# The README's test command: set up .venv (with test extras), then run every
# test that needs no GPU. Docker/compose tests need a running engine
# (deploy/docker/install-engine.sh); ROLLOUT_SIDECAR_REQUIRE_DOCKER=1 turns
# their skip into a failure, which CI sets.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh --test
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -m "not gpu" "$@"
