"""Waiting on what a test can observe, never on a fixed sleep: a condition
polled to a deadline, and the server's own counters from /metrics (the
engine's, so "the request is decoding" is read, not assumed)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

POLL_S = 0.05


def until(condition: Callable[[], Any], what: str, timeout_s: float = 60) -> None:
    """Return once `condition()` is true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f}s: {what}"
        time.sleep(POLL_S)


def sample(metrics_text: str, name: str) -> float:
    """The value of the sample `name` in a /metrics page."""
    return next(s.value for f in text_string_to_metric_families(metrics_text) for s in f.samples
                if s.name == name)


def metric(server: Any, name: str) -> float:
    """`name` on `server`'s /metrics now."""
    return sample(httpx.get(server.url + "/metrics", timeout=30).text, name)


def engine_tokens(server: Any) -> float:
    """Tokens the engine has sampled so far, delivered or not."""
    return metric(server, "rollout_sidecar_engine_generation_tokens_total")


def until_decoding(server: Any, tokens_before: float, what: str) -> None:
    """Until the engine sampled a token since `tokens_before`: the request
    sent since then is admitted and decoding."""
    until(lambda: engine_tokens(server) > tokens_before, what)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True once a listener can bind `port` again (as servers bind: SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
