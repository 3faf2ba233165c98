"""The shared server launcher (server/launcher.py) and the CLI's plugin
commands, without starting vLLM: a server that fails at once, a process that
never becomes ready, one that ignores SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from importlib.metadata import EntryPoint

import pytest

from rollout_sidecar.server.launcher import (
    DEFAULT_ENV,
    ServerProcess,
    ServerStartError,
    free_port,
    launch_server,
    stop_process,
)
from tests import processes


def test_a_server_that_exits_raises_with_its_log_tail(tmp_path):
    # A usage error: the CLI exits before it imports the engine.
    with pytest.raises(ServerStartError, match=r"(?s)exited 2.*no-such-flag"):
        launch_server(log=tmp_path / "s.log", args=["--no-such-flag"], ready_timeout_s=60)


def test_tokens_reach_the_server_by_environment_only(tmp_path):
    s = launch_server(log=tmp_path / "s.log", args=["--no-such-flag"], wait=False,
                      api_token="a" * 8, env={"ROLLOUT_SIDECAR_ADMIN_TOKEN": "b" * 8})
    s.stop()
    assert (s.api_token, s.admin_token) == ("a" * 8, "b" * 8)
    assert s.env["ROLLOUT_SIDECAR_API_TOKEN"] == "a" * 8
    assert not any("a" * 8 in arg or "b" * 8 in arg for arg in s.proc.args)
    assert s.url == f"http://127.0.0.1:{s.port}"


def test_the_kv_cache_is_left_to_the_server_unless_given(tmp_path, monkeypatch):
    """`serve` sizes vLLM-CPU's KV cache itself; a VLLM_CPU_KVCACHE_SPACE in the
    environment or in `env` still reaches it."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    s = launch_server(log=tmp_path / "s.log", args=["--no-such-flag"], wait=False)
    s.stop()
    assert "VLLM_CPU_KVCACHE_SPACE" not in s.env
    s = launch_server(log=tmp_path / "s.log", args=["--no-such-flag"], wait=False,
                      env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    s.stop()
    assert s.env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def _stubborn() -> subprocess.Popen:
    """A process that ignores SIGTERM (and serves nothing)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
         "signal.SIG_IGN); print('up', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    return proc


def test_a_server_never_ready_is_stopped_after_the_bound(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("still loading the model\n")
    port = free_port()
    s = ServerProcess(f"http://127.0.0.1:{port}", port, free_port(), "a", "b", _stubborn(),
                      log, {})
    t = time.monotonic()
    with pytest.raises(ServerStartError, match=r"(?s)not ready after 1s.*still loading"):
        s.wait_ready(timeout_s=1, poll_s=0.1)
    assert s.proc.poll() is not None and time.monotonic() - t < 30


def test_stop_escalates_leaving_the_stuck_processs_stacks(tmp_path):
    """SIGTERM ignored: SIGABRT, on which faulthandler prints where it is stuck."""
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
             "signal.SIG_IGN); print('up', flush=True); time.sleep(120)"],
            stdout=subprocess.PIPE, stderr=f, text=True,
            env=dict(os.environ, **DEFAULT_ENV))
    assert proc.stdout.readline() == "up\n"
    assert stop_process(proc, timeout_s=0.5) == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in err.read_text() and "line 1" in err.read_text()


def test_the_server_cli_gets_the_demo_from_an_entry_point_without_importing_it():
    code = ("import sys, rollout_sidecar.server.cli as cli; "
            "print(sorted(c.name for c in cli.app.registered_commands), "
            "sorted(m for m in sys.modules if m.startswith('rollout_sidecar.demo.')))")
    r = processes.run([sys.executable, "-c", code], timeout_s=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip()
    # Only the commands' light modules (typer), never the launcher or the loop.
    assert out == ("['demo', 'doctor', 'drain', 'serve'] "
                   "['rollout_sidecar.demo.cli', 'rollout_sidecar.demo.doctor']"), out


def test_a_broken_plugin_command_is_skipped_with_a_warning(monkeypatch, capsys):
    import typer

    import rollout_sidecar.server.cli as cli

    broken = EntryPoint("oops", "rollout_sidecar.no_such_module:cmd", cli.COMMANDS_GROUP)
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [broken])
    target = typer.Typer()
    assert cli.add_plugin_commands(target) == []
    assert "command 'oops'" in capsys.readouterr().err


def test_the_launcher_imports_nothing_heavy():
    """Tests and benches import it: no engine, no torch, no web framework."""
    code = ("import sys, rollout_sidecar.server.launcher; print(sorted(m for m in "
            "('torch', 'vllm', 'transformers', 'fastapi') if m in sys.modules))")
    r = processes.run([sys.executable, "-c", code], timeout_s=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip()
    assert out == "[]", out


@pytest.mark.parametrize("max_model_len", [16, 64, 2048])
def test_warmup_requests_pass_the_servers_own_checks(max_model_len):
    from rollout_sidecar.server.config import ServerSettings
    from rollout_sidecar.server.generate.request_checks import check_request
    from rollout_sidecar.server.generate.warmup import warmup_requests

    reqs = warmup_requests(vocab_size=264, max_model_len=max_model_len)
    assert reqs["score"].sampling.prompt_logprobs and reqs["rollout_seeded"].sampling.logprobs
    for req in reqs.values():
        check_request(req, ServerSettings(), max_model_len, 264)
        for ids in req.prompt_token_ids:
            assert all(0 <= t < 264 for t in ids)
            assert len(ids) + req.sampling.max_tokens <= max_model_len


def test_a_failed_warmup_is_never_fatal():
    """A fake engine (unit test) whose vLLM raises: the server starts anyway."""
    import asyncio

    from rollout_sidecar.server.engine.lifecycle import EngineInfo
    from rollout_sidecar.server.generate.warmup import warm_up

    class LLM:
        def generate(self, *args, **kwargs):
            raise RuntimeError("no kernel for this shape")

    class Fake:
        llm = LLM()
        info = EngineInfo(model="m", dtype="float32", lm_head_dtype="float32",
                          max_model_len=64, vocab_size=264)

    assert asyncio.run(warm_up(Fake())) == {}  # type: ignore[arg-type]
