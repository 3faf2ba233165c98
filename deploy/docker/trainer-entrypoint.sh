#!/usr/bin/env bash
# trainer-entrypoint.sh: the trainer image's entrypoint (installed as
# /usr/local/bin/rollout-sidecar-trainer).
#
# With no arguments: run the RL demo against the server, configured through
# the environment so compose (and `docker run -e`) can set it:
#   ROLLOUT_SIDECAR_URL  server base URL            [http://server:8000]
#   DEMO_STEPS           optimizer steps            [30]
#   DEMO_OUT_DIR         where report.json/.png go  [/out]
#   DEMO_ARGS            extra `rollout-sidecar demo` flags, word-split
#                        (e.g. "--seed 1 --nproc 2")
# Tokens come from ROLLOUT_SIDECAR_API_TOKEN / ROLLOUT_SIDECAR_ADMIN_TOKEN.
# With arguments: run them instead (a command override, e.g. a smoke test).
# Exits with the demo's exit code.
set -euo pipefail

if [ "$#" -gt 0 ]; then
    exec "$@"
fi

url=${ROLLOUT_SIDECAR_URL:-http://server:8000}
out=${DEMO_OUT_DIR:-/out}
mkdir -p "$out"
# shellcheck disable=SC2086  # DEMO_ARGS is a flag list: split it on purpose
exec rollout-sidecar demo --server-url "$url" --steps "${DEMO_STEPS:-30}" \
    --out-dir "$out" ${DEMO_ARGS:-}
