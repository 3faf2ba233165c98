#!/usr/bin/env bash
# The `gpu` tests on a lent device machine (torch, transformers, peft there; no vLLM,
# nothing fetched). Wheels for what it lacks travel in .whl/ (git-ignored; see
# docs/gpu.md "Running the gpu tests"). Writes the log and a JUnit file to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/pkg . \
  || exit 1
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'devices', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version(), \
'host_emptyCache', hasattr(torch._C, '_host_emptyCache'))" | tee -a "$OUT/gpu.txt"
python3 -m pytest tests/gpu "$@" -v -p no:cacheprovider \
  --timeout 240 --junitxml "$OUT/junit.xml" 2>&1 | tee "$OUT/log.txt"
