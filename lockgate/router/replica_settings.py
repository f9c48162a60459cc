"""Settings that belong to each replica: Triton's logging and trace extensions
(`/v2/logging`, `/v2[/models/{m}]/trace/setting`, gRPC `LogSettings` and `TraceSetting`).

The router refuses them (HTTP 501, gRPC UNIMPLEMENTED) instead of passing them on: sent to one
replica picked by the balancer, a change would apply to that replica alone, and a read would
describe whichever replica answered. An operator sends them to each replica's own address.
"""

from __future__ import annotations

MESSAGE = (
    "log and trace settings belong to each replica, and the router holds none: send "
    "/v2/logging and /v2/trace/setting (gRPC LogSettings, TraceSetting) to each replica's "
    "own address"
)
METHODS = frozenset(
    {"/inference.GRPCInferenceService/LogSettings", "/inference.GRPCInferenceService/TraceSetting"}
)


def per_replica(path: str) -> bool:
    """Whether an HTTP path reads or changes a replica's own log or trace settings."""
    if path in ("/v2/logging", "/v2/trace/setting"):
        return True
    parts = path.split("/")  # "", "v2", "models", name, "trace", "setting"
    return len(parts) == 6 and parts[1:3] == ["v2", "models"] and parts[4:] == ["trace", "setting"]
