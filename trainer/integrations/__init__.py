"""Trainer frameworks driven by rollout-sidecar. `rollout_sidecar.trainer`
never imports this package, so it never needs a framework installed:
- `integrations/trl.py`: TRL's GRPOTrainer (imports trl inside its functions);
- `integrations/trl_async.py`: TRL's AsyncGRPOTrainer (imports trl at the top:
  it subclasses TRL's classes, so import it only where trl is installed);
- `integrations/verl/`: verl 0.9.1's rollout replicas, checkpoint engine and
  rollout adapter (imports verl at the top, and registers them on import)."""
