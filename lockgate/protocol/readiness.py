"""Why a server says it is not ready: the `error` of `/v2/health/ready`'s 503
(`{"ready": false, "error": ...}`), as the server writes it and the router reads it. The router
tells a model control request to a replica that is up but not ready for another reason (no
model loaded yet, in explicit model control mode), never to one still loading its start-up
models or draining."""

from __future__ import annotations

DRAINING = "draining"
LOADING = "loading models"
NO_MODEL = "no model is loaded"
BUSY = frozenset({DRAINING, LOADING})  # not to be told model control requests now
