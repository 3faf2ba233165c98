"""A stub at a peer's address, answering as a replica would with weights
nobody trained: all zeros as version 10**12, and a challenge proof it
cannot make (it has no admin token). bench/hostile_requests.py and
tests/e2e/test_catch_up.py start a replica with `--peers` naming it; it
records every header it is sent, so a test can check the token never
reached it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def one_slot_buckets(index: dict) -> tuple[list[dict], list[int]]:
    """A manifest of one tensor a bucket from GET /weights/index, and the sizes."""
    buckets, sizes = [], []
    for i, (name, info) in enumerate(index["tensors"].items()):
        size = 4 if info["dtype"] == "float32" else 2
        for d in info["shape"]:
            size *= d
        sizes.append(size)
        buckets.append({"index": i, "nbytes": size, "params": [
            {"name": name, "dtype": info["dtype"], "shape": info["shape"], "offset": 0}]})
    return buckets, sizes



class RogueStub:
    """Answers /weights/status, /weights/staged and its buckets as a peer
    would, with zeros as version 10**12, and a made-up challenge proof."""

    def __init__(self, server: ThreadingHTTPServer, seen: list[dict]) -> None:
        self.server, self.seen = server, seen
        self.url = f"http://127.0.0.1:{server.server_address[1]}"

    @classmethod
    def serve(cls, status: dict, index: dict) -> RogueStub:
        from rollout_sidecar.protocol.data_plane.bucket_check import crc32_of_bytes

        version = 10**12
        buckets, sizes = one_slot_buckets(index)
        st = dict(status, weight_version=version, delta_base=version, boot_id="rogue",
                  broken=None)
        seen: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def _send(self, data: bytes, headers: dict[str, str]) -> None:
                self.send_response(200)
                for k, v in {"content-length": str(len(data)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802
                seen.append(dict(self.headers))
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self._send(json.dumps({"nonce": "ab" * 32, "proof": "00" * 32}).encode(), {})

            def do_GET(self) -> None:  # noqa: N802
                seen.append(dict(self.headers))
                if self.path == "/weights/status":
                    self._send(json.dumps(st).encode(), {})
                elif self.path == "/weights/staged":
                    self._send(json.dumps({"version": version, "buckets": buckets}).encode(), {})
                else:
                    data = bytes(sizes[int(self.path.rsplit("/", 1)[1])])
                    self._send(data, {"X-Weight-Version": str(version),
                                      "X-Checksum": str(crc32_of_bytes(data))})

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return cls(server, seen)

    def close(self) -> None:
        self.server.shutdown()
