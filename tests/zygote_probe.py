"""Run through a test zygote by tests/test_server_zygote_units.py: prints
what the forked child got (argv, working directory, environment, session),
writes to the socket it was passed by number, then exits as told."""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    fd, then = int(sys.argv[1]), sys.argv[2]
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(),
                      "probe": os.environ.get("ROLLOUT_SIDECAR_PROBE"),
                      "own_session": os.getsid(0) == os.getpid(), "name": __name__,
                      "title": open("/proc/self/cmdline").read().split()}), flush=True)
    os.write(fd, b"through the passed fd")
    if then == "sleep":
        time.sleep(120)
    sys.exit(int(then))
