"""How one try of an HTTP call can fail at the transport, by what the
replica saw of it. The client retries on these (client/request_plans.py);
the pusher names them (trainer/control/admin_client.py)."""

from __future__ import annotations

import httpx

# Never reached the server: nothing of the request was applied.
NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
# Reached it and heard nothing: a frozen replica, or httpx's own read bound.
STALLED = (httpx.ReadTimeout, httpx.WriteTimeout)
# Lost the connection mid-request.
RESET = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
