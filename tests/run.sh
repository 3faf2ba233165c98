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
bash deploy/setup.sh --test
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -m "$markers" "$@"
