"""Server side of rollout-sidecar: vLLM's AsyncLLM behind FastAPI, plus the
weight routes that stage, check and atomically commit pushed weights."""
