"""The protocol every side speaks: what the trainer, the server and the
client share, importing none of them.

- `schema/` (pydantic, no torch, no httpx): every JSON type of the generation
  API, the push control plane and adapters, and the route table (every
  route's method, path, access and types).
- `data_plane/` (torch.distributed): the group that carries the buckets
  (gloo, or NCCL on a communicator of our own), its signed rendezvous, the
  bucket bytes' dtypes, CRC-32 and tags, and a delta's sparse patches. Both
  ends build it: trainer rank 0 sends, every engine worker receives.
- `calls/` (httpx, no torch): a long HTTP call to a replica, watched by a
  liveness ping, and how a try fails at the transport; the client's calls
  and the pusher's control calls both go this way.

tests/test_import_boundaries.py holds each part to these imports.
"""
