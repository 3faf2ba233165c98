"""The vLLM API check (tests/vllm_api): clean against the vLLM installed
here (so its handle map and scanner stay right as the code changes), and able
to fail: on a small vLLM tree written here, every kind of use that is gone is
named with our file and line. CI runs it against the newest GPU wheel the
gpu extra admits (.ci/run)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import vllm

from tests.vllm_api.check import REPO, check
from tests.vllm_api.source import Tree
from tests.vllm_api.uses import collect


def test_every_vllm_name_our_code_uses_exists_in_the_installed_vllm():
    uses = collect(REPO)
    gone, unknown = check(Tree(Path(vllm.__file__).parents[1]), uses)
    assert len(uses) > 100 and not gone, gone  # it reads a lot, and all of it is there
    assert unknown <= 3, unknown


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_gone_module_name_attribute_or_keyword_is_named_where_we_use_it(tmp_path):
    _write(tmp_path / "vllm", {
        "vllm/__init__.py": "",
        "vllm/v1/__init__.py": "", "vllm/v1/engine/__init__.py": "",
        "vllm/v1/engine/async_llm.py": """
            class EngineClient:
                def check_health(self): ...
            class AsyncLLM(EngineClient):
                def __init__(self, vllm_config):
                    self.model_config = vllm_config.model_config
                async def pause_generation(self, *, mode="abort"): ...
            """,
        "vllm/entrypoints/__init__.py": "", "vllm/entrypoints/common/__init__.py": "",
        "vllm/entrypoints/common/cli_args.py": "def make_arg_parser(p): ...",
        "vllm/args.py": """
            from dataclasses import dataclass
            @dataclass
            class EngineArgs:
                model: str = ""
            @dataclass
            class AsyncEngineArgs(EngineArgs):
                enable_log_requests: bool = False
            """,
    })
    _write(tmp_path / "ours", {"server/a.py": """
        from vllm.args import AsyncEngineArgs
        from vllm.gone import thing
        try:
            from vllm.entrypoints.common.cli_args import make_arg_parser
        except ImportError:
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
        try:
            from vllm.nowhere import a
        except ImportError:
            from vllm.neither import a

        async def f(self):
            AsyncEngineArgs(model="m", nnodes=2)
            await self.llm.pause_generation(mode="keep", clear_cache=True)
            self.llm.check_health()
            return self.llm.model_config, self.llm.output_processor
        """})
    gone, _ = check(Tree(tmp_path / "vllm"), collect(tmp_path / "ours", ("server",)))
    assert gone == sorted([
        "server/a.py:14: vllm.args.AsyncEngineArgs(model=, nnodes=): no keyword nnodes",
        "server/a.py:15: vllm.v1.engine.async_llm.AsyncLLM.pause_generation(mode=, "
        "clear_cache=): no keyword clear_cache",
        "server/a.py:17: vllm.v1.engine.async_llm.AsyncLLM.output_processor: no attribute "
        "output_processor",
        "server/a.py:3: vllm.gone.thing: gone",
        "server/a.py:9: vllm.nowhere.a: gone", "server/a.py:11: vllm.neither.a: gone",
    ]), gone  # the cli_args fallback resolves once: not gone


def test_the_surface_is_read_member_by_member_and_the_fakes_have_what_they_stand_in_for():
    """Every member of server/engine/vllm_surface.py's protocols is a use the
    check reads (a rename in vLLM fails there); and the unit tests' fakes of
    vLLM's engine have each method of the protocol their code is typed with."""
    from rollout_sidecar.server.engine import vllm_surface
    from tests.test_disconnect_units import _FakeLLM as PlaneLLM
    from tests.test_gpu_readiness_units import _FakeLLM as OpsLLM
    from tests.test_openai_units import FakeLLM as SamplingLLM

    read = {(u.target, u.attr) for u in collect(REPO) if "vllm_surface" in u.where}
    for protocol, cls in vllm_surface.STANDS_FOR.items():
        members = {n for n in vars(protocol) if not n.startswith("_")} | set(
            getattr(protocol, "__annotations__", {}))
        assert {(cls, m) for m in members} <= read, protocol

    def methods(protocol: type) -> set[str]:
        return {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}

    for fake in (OpsLLM, PlaneLLM):  # ops.py, the data plane: WorkerRpc
        assert methods(vllm_surface.WorkerRpc) <= set(dir(fake)), fake
    # The /v1 client (openai_api/compat.py) submits and aborts; it never calls generate.
    assert {"add_request", "abort"} <= set(dir(SamplingLLM)) & methods(vllm_surface.Sampler)
