"""The floor: the least a Python HTTP server can do to serve one ONNX model.

A raw ASGI app (no framework) on uvicorn with uvloop and httptools. It answers
`POST /v2/models/<name>/infer` with KServe v2 JSON by running onnxruntime inline on the event
loop (1 intra-op thread), and `GET /v2/health/ready`. No validation beyond what the decoder
does, no batching, no metrics: whatever lockgate adds on top of this is its overhead.

    python -m benchmarks.floor_app MODEL.onnx --port 8000
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec
import numpy as np
import onnxruntime as ort

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_NUMPY = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}
_V2 = {"float32": "FP32", "float64": "FP64", "int64": "INT64", "int32": "INT32"}


class FloorApp:
    def __init__(self, model_path: str) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(model_path, sess_options=options)
        self.outputs = [o.name for o in self.session.get_outputs()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "POST" and scope["path"].endswith("/infer"):
            body = await _read_body(receive)
            await _respond(send, 200, self.infer(body, scope["path"].split("/")[3]))
        elif scope["path"] == "/v2/health/ready":
            await _respond(send, 200, b"")
        else:
            await _respond(send, 404, b'{"error":"not found"}')

    def infer(self, body: bytes, model: str) -> bytes:
        request = msgspec.json.decode(body)
        feeds = {
            t["name"]: np.asarray(t["data"], dtype=_NUMPY[t["datatype"]]).reshape(t["shape"])
            for t in request["inputs"]
        }
        results = self.session.run(self.outputs, feeds)
        outputs = [
            {
                "name": n,
                "datatype": _V2[str(r.dtype)],
                "shape": list(r.shape),
                "data": r.ravel().tolist(),
            }
            for n, r in zip(self.outputs, results, strict=True)
        ]
        return msgspec.json.encode({"model_name": model, "outputs": outputs})


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _respond(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("model", help="path to an ONNX model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(
        FloorApp(args.model),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        lifespan="off",
    )


if __name__ == "__main__":
    main()
