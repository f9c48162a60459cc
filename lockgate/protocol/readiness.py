"""Why a server says it is not ready: the `error` of `/v2/health/ready`'s 503
(`{"ready": false, "error": ...}`), as the server writes it and the router reads it. The router
tells a model control request to a replica that is up but not ready for another reason (no
model loaded yet, in explicit model control mode), never to one still loading its start-up
models or draining.

Every health answer (`/v2/health/live`, `/health`, `/v2/health/ready`) also carries the
server's boot id (`BOOT_HEADER`), drawn at random when its process starts: a router that
sees it change knows the replica started again, and lost the models it was told to load,
even when no probe found it down.
"""

from __future__ import annotations

import secrets

DRAINING = "draining"
LOADING = "loading models"
NO_MODEL = "no model is loaded"
BUSY = frozenset({DRAINING, LOADING})  # not to be told model control requests now

BOOT_HEADER = b"x-lockgate-boot"


def boot_id() -> bytes:
    """A new process's boot id: 64 random bits, in hex."""
    return secrets.token_hex(8).encode()
