"""A call to a replica over HTTP (httpx, no torch): `liveness` (the
process-wide ping of a replica), `stall_watch` (a long call kept while its
replica answers the ping), `failures` (how a try fails at the transport).
Import each module by name."""
