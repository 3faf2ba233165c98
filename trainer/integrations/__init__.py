"""Trainer frameworks driven by rollout-sidecar. Each module imports its
framework lazily (inside functions), so `rollout_sidecar.trainer` never needs
one installed: `integrations/trl.py` for TRL's GRPOTrainer."""
