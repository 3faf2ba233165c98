"""Unit tests of which listed replicas take part in a push
(`ServingState.read`): one joining (not answering yet), restarting (refusing
connections after it answered: restarting, or gone) or leaving (503 while it drains) sits the push
out and is named; a frozen or refusing one still fails it. No server: each
replica's admin client answers what `/weights/status` would, or raises what
`WeightAdminClient` raises for the failure (its mapping of connection errors
and HTTP statuses is tested at the bottom, against httpx's mock transport).
The fleet changing under a real trainer, real servers and clients:
bench/elastic_fleet.py, whose run is in docs/replicas.md."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from rollout_sidecar.protocol.schema import TensorInfo, WeightIndex, WeightStatus
from rollout_sidecar.trainer.control.admin_client import WeightAdminClient
from rollout_sidecar.trainer.control.deadlines import Deadlines
from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins
from rollout_sidecar.trainer.control.serving_state import ServingState
from rollout_sidecar.trainer.errors import ReplicaError, WeightPushError
from rollout_sidecar.trainer.transport.distributed import DistributedTransport

A, B, C = "http://a:1", "http://b:1", "http://c:1"
INDEX = WeightIndex(tensors={"w": TensorInfo(shape=[2], dtype="float32")}, ignored=[],
                    tie_word_embeddings=False)


def status(boot: str = "boot-1", version: int = 3) -> WeightStatus:
    return WeightStatus(weight_version=version, dtype="float32", vocab_size=96,
                        max_model_len=64, boot_id=boot, push_state="idle",
                        push_in_progress=False, connected=None, data_plane_port=1,
                        transports=["gloo"], push_timeout_s=1, commit_drain_s=1)


def unreachable(url: str) -> ReplicaError:
    return ReplicaError(url, "status", "unreachable", "no connection (ConnectError)")


def draining(url: str) -> ReplicaError:
    return ReplicaError(url, "status", "refused", "GET /weights/status -> HTTP 503: server is "
                        "shutting down", 503)


class Fleet:
    """Replicas whose status answers are set per URL: a status, or an error."""

    def __init__(self, *urls: str) -> None:
        self.answers: dict[str, WeightStatus | Exception] = {u: status() for u in urls}
        self.indexed: list[str] = []
        self.replicas = ReplicaAdmins(",".join(urls), token=None)
        self._wire()

    def _wire(self) -> None:
        for admin in self.replicas.listed:
            admin.status = self._answer(admin.base_url)  # type: ignore[method-assign]
            admin.index = self._index(admin.base_url)  # type: ignore[method-assign]

    def _answer(self, url: str) -> Callable[[], WeightStatus]:
        def call() -> WeightStatus:
            answer = self.answers[url]
            if isinstance(answer, Exception):
                raise answer
            return answer
        return call

    def _index(self, url: str) -> Callable[[], WeightIndex]:
        def call() -> WeightIndex:
            self.indexed.append(url)
            return INDEX
        return call

    def relist(self, *urls: str) -> None:
        """The name now resolves to `urls` (a dns+ name's pods changed)."""
        for u in urls:
            self.answers.setdefault(u, status())
        self.replicas.spec = ",".join(urls)
        self.replicas.refresh()
        self._wire()


def test_a_replica_not_answering_yet_is_joining_and_the_push_goes_on_without_it():
    fleet, serving = Fleet(A, B), ServingState()
    fleet.answers[B] = unreachable(B)
    assert serving.read(fleet.replicas, 4) is False
    assert fleet.replicas.urls == [A] and len(serving.statuses) == 1
    assert list(fleet.replicas.absent) == [B]
    assert fleet.replicas.absent[B].startswith("joining")
    assert fleet.indexed == [A]
    # It answers: the next push takes it, and its index is checked against A's.
    fleet.answers[B] = status("boot-b")
    assert serving.read(fleet.replicas, 5) is False  # first seen now: not a restart
    assert fleet.replicas.urls == [A, B] and fleet.replicas.absent == {}
    assert fleet.indexed == [A, A, B]


def test_a_replica_that_refuses_after_it_answered_is_away_then_shows_its_restart():
    fleet, serving = Fleet(A, B), ServingState()
    serving.read(fleet.replicas, 4)
    fleet.answers[B] = unreachable(B)
    serving.read(fleet.replicas, 5)
    assert fleet.replicas.absent[B].startswith("away")
    fleet.answers[B] = status("boot-2", version=0)  # back on its checkpoint
    assert serving.read(fleet.replicas, 6) is True
    assert fleet.replicas.urls == [A, B]


def test_a_draining_replica_is_leaving():
    fleet, serving = Fleet(A, B, C), ServingState()
    fleet.answers[C] = draining(C)
    serving.read(fleet.replicas, 4)
    assert fleet.replicas.urls == [A, B]
    assert fleet.replicas.absent[C] == ("leaving: GET /weights/status -> HTTP 503: server is "
                                        "shutting down")


@pytest.mark.parametrize("error", [
    ReplicaError(B, "status", "frozen", "connected, then silent for 15s"),
    ReplicaError(B, "status", "refused", "GET /weights/status -> HTTP 401: bad token", 401),
    RuntimeError("a bug"),
], ids=["frozen", "refused", "other"])
def test_a_fault_still_fails_the_push_naming_the_replica(error):
    fleet, serving = Fleet(A, B), ServingState()
    fleet.answers[B] = error
    with pytest.raises(WeightPushError) as e:
        serving.read(fleet.replicas, 4)
    assert str(e.value).startswith("status failed on 1 of 2 replicas: ") and B in str(e.value)


def test_raise_makes_an_absent_replica_fail_the_push():
    fleet, serving = Fleet(A, B), ServingState()
    fleet.answers[B] = unreachable(B)
    with pytest.raises(WeightPushError, match="status failed on 1 of 2 replicas: http://b:1"):
        serving.read(fleet.replicas, 4, on_absent_replica="raise")


def test_no_replica_to_push_to_fails_the_push_naming_each():
    fleet, serving = Fleet(A, B), ServingState()
    fleet.answers[A], fleet.answers[B] = unreachable(A), draining(B)
    with pytest.raises(WeightPushError, match="no replica can take this push: ") as e:
        serving.read(fleet.replicas, 4)
    assert f"{A}: joining" in str(e.value) and f"{B}: leaving" in str(e.value)


def test_the_group_forms_without_an_absent_replica_and_again_once_it_answers():
    """The data-plane group holds exactly the replicas taking part: a joiner
    answering for the first time means a new group, never a broadcast
    waiting for a rank that never joined."""
    fleet, serving = Fleet(A, B), ServingState()
    t = DistributedTransport(fleet.replicas)
    fleet.answers[B] = unreachable(B)
    serving.read(fleet.replicas, 4)
    assert t.plan_connect(serving.statuses, 1) is not None
    assert t.members == ((A, 1),)
    fleet.answers[B] = status("boot-b")
    serving.read(fleet.replicas, 5)
    assert not t.connected(serving.statuses, 1)
    assert t.plan_connect(serving.statuses, 1) is not None and t.members == ((A, 1), (B, 1))


def test_a_replica_that_left_the_list_is_gone_and_one_that_joined_it_is_asked():
    fleet, serving = Fleet(A, B), ServingState()
    serving.read(fleet.replicas, 4)
    fleet.relist(A, C)
    serving.read(fleet.replicas, 5)
    assert fleet.replicas.urls == [A, C] and fleet.replicas.absent == {}


# ---------------------------------------------- what the admin client raises


def answering(status_code: int, error: str) -> WeightAdminClient:
    admin = WeightAdminClient("http://r", "t", Deadlines(stall_s=0.5))
    admin._http = httpx.Client(base_url="http://r", transport=httpx.MockTransport(
        lambda r: httpx.Response(status_code, json={"error": error})))
    return admin


def test_the_admin_client_says_what_a_draining_server_answered():
    with pytest.raises(ReplicaError) as e:
        answering(503, "server is shutting down").status()
    assert (e.value.what, e.value.status) == ("refused", 503)
    with pytest.raises(ReplicaError) as e:
        answering(401, "bad token").status()
    assert e.value.status == 401


def test_nobody_listening_is_unreachable_with_no_status():
    import socket

    with socket.socket() as s:  # a port bound, not listening: refused at once
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(ReplicaError) as e:
            WeightAdminClient(url, "t", Deadlines(stall_s=0.5)).status()
    assert (e.value.what, e.value.status) == ("unreachable", None)
