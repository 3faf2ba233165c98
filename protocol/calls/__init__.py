"""A call to a replica over HTTP (httpx, no torch): `liveness` (the
process-wide ping of a replica), `stall_watch` (a long call kept while its
replica answers the ping), `failures` (how a try fails at the transport),
`tls` (the one TLS context every httpx client of ours shares).
Import each module by name."""
