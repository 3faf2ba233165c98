"""The data plane both ends build (torch.distributed): `bucket_group` (the
group and how one bucket is sent and received; gloo here, NCCL through
`nccl_group` and `nccl_library`), `signed_store` (its signed rendezvous),
`wire_format` (dtypes, CRC-32, slot views of a bucket's bytes), `bucket_mac`
(each bucket's keyed tag), `delta_codec` (a tensor's sparse patches).
Import each module by name."""
