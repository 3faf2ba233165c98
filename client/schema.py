"""Deprecated alias of `rollout_sidecar.client.protocol`, kept for one minor
version (0.1.x): import the wire types from there."""

from rollout_sidecar.client.protocol import *  # noqa: F403
from rollout_sidecar.client.protocol import __all__  # noqa: F401
