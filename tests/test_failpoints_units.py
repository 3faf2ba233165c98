"""The failpoint facility (protocol/failpoints.py): off unless armed, armed in
the process or from the file a server's workers read, one rank at a time,
and a misspelt name refused. Unit tests: no server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rollout_sidecar.protocol import failpoints
from rollout_sidecar.protocol.failpoints import ENV, FAILPOINTS, armed, fire

ROOT = Path(__file__).resolve().parents[1]


def test_off_unless_armed(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert all(fire(name) is None for name in FAILPOINTS)


def test_armed_in_the_process_for_the_block_only():
    seen = []
    with armed("push.send", lambda index, buf, rank=None: seen.append(index) or "x"):
        assert fire("push.send", index=3, buf=b"") == "x"
    assert seen == [3] and fire("push.send", index=4, buf=b"") is None


def test_armed_from_the_file_read_at_every_hit_and_per_rank(tmp_path, monkeypatch):
    spec = tmp_path / "failpoints"
    monkeypatch.setenv(ENV, str(spec))
    spec.write_text("load.drop:model.norm.weight@1")
    assert fire("load.drop", rank=1) == "model.norm.weight"
    assert fire("load.drop", rank=0) is None and fire("load.stale", rank=1) is None
    spec.write_text("load.crash")  # no rank: every rank; no argument: ""
    assert fire("load.crash", rank=0) == "" and fire("load.crash", rank=1) == ""
    spec.write_text("")
    assert fire("load.crash", rank=0) is None


def test_a_misspelt_failpoint_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no failpoint 'load.dorp'"):
        with armed("load.dorp", lambda **_: None):
            pass
    spec = tmp_path / "failpoints"
    spec.write_text("crash")  # the old spelling fires nothing: it fails loudly
    monkeypatch.setenv(ENV, str(spec))
    with pytest.raises(ValueError, match="no failpoint 'crash'"):
        fire("load.crash", rank=0)
    spec.write_text("push.send")  # its action is code: a file cannot give one
    with pytest.raises(ValueError, match="in the process only"):
        fire("load.crash", rank=0)


def test_every_failpoint_has_one_site_and_every_site_a_row():
    """The table and the code agree: no row without its `fire`, no `fire`
    of a name that is not a row."""
    sites: dict[str, list[str]] = {}
    for pkg in ("trainer", "server", "client", "protocol"):
        for path in (ROOT / pkg).rglob("*.py"):
            for name in re.findall(r'fire\("([\w.]+)"', path.read_text()):
                sites.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert set(sites) == set(FAILPOINTS), sites
    assert all(len(where) == 1 for where in sites.values()), sites
    assert failpoints._actions == {}
