"""Trainer frameworks driven by rollout-sidecar. `rollout_sidecar.trainer`
never imports this package, so it never needs a framework installed:
- `integrations/trl.py`: TRL's GRPOTrainer (imports trl inside its functions);
- `integrations/trl_async.py`: TRL's AsyncGRPOTrainer (imports trl at the top:
  it subclasses TRL's classes, so import it only where trl is installed)."""
