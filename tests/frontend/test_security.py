"""Security basics through a real server: API keys, admin keys, keys kept out of the log,
the body limit, the connection limit, and model files confined to the repository."""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningServer, start_server
from tests.frontend.test_hostile_input import exchange, read_response, request_bytes

API_KEYS = ("k1-secret-alpha", "k2-secret-beta")
ADMIN_KEY = "adm-secret-gamma"
WRONG_KEY = "wrong-secret-delta"
LIMIT = 8  # --limit-concurrency
ECHO = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}

OUTSIDE_MODEL = """
from pathlib import Path
Path(__file__).with_name("EXECUTED").write_text("outside code ran")

class Model:
    def load(self, config, version_dir):
        pass

    def infer(self, inputs):
        return {"y": inputs["x"]}
"""


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder outside the repository holding a python model that marks when it runs."""
    folder = tmp_path_factory.mktemp("outside")
    (folder / "1").mkdir()
    (folder / "1" / "model.py").write_text(OUTSIDE_MODEL)
    return folder


@pytest.fixture(scope="module")
def secured(
    test_repo: Path, outside: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("secure-repo")
    shutil.copytree(test_repo / "echo", repo / "echo")
    # a model folder that is a symlink leading out of the repository
    shutil.copy(test_repo / "echo" / "config.yaml", outside / "config.yaml")
    (repo / "escape").symlink_to(outside, target_is_directory=True)
    # a model folder inside whose model file is a symlink leading out
    (repo / "linked" / "1").mkdir(parents=True)
    shutil.copy(test_repo / "echo" / "config.yaml", repo / "linked" / "config.yaml")
    (repo / "linked" / "1" / "model.py").symlink_to(outside / "1" / "model.py")
    env = {"LOCKGATE_API_KEYS": ",".join(API_KEYS), "LOCKGATE_ADMIN_KEYS": ADMIN_KEY}
    running = start_server(
        repo,
        tmp_path_factory.mktemp("secure-server"),
        "--no-llm",
        "--max-body-mb",
        "1",
        "--limit-concurrency",
        str(LIMIT),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        env=env,
    )
    yield running
    running.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, (response.status_code, response.text[:300])
    message: str = response.json()["error"]
    return message


# -- API keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/v2/health/live", "/v2/health/ready", "/health", "/openapi.json"]
)
def test_public_routes_need_no_key(secured: RunningServer, path: str) -> None:
    assert httpx.get(secured.url + path).status_code == 200


def test_metrics_need_a_key_when_keys_are_set(secured: RunningServer) -> None:
    """Metrics name models and traffic: with keys set they are guarded, unless the server
    was started with --metrics-public."""
    assert "missing API key" in error_of(httpx.get(secured.url + "/metrics"), 401)
    ok = httpx.get(secured.url + "/metrics", headers=bearer(API_KEYS[0]))
    assert ok.status_code == 200 and "lockgate_requests_total" in ok.text


GUARDED = [
    ("GET", "/v2"),
    ("GET", "/v2/models/echo"),
    ("GET", "/v2/models/echo/ready"),
    ("GET", "/v2/models/echo/config"),
    ("GET", "/v2/models/echo/stats"),
    ("GET", "/v2/models/stats"),
    ("POST", "/v2/repository/index"),
    ("GET", "/v2/models/no_such_model"),  # no key: no hint whether the model exists
]


@pytest.mark.parametrize(("method", "path"), GUARDED)
def test_metadata_routes_need_a_key(secured: RunningServer, method: str, path: str) -> None:
    url = secured.url + path
    assert "missing API key" in error_of(httpx.request(method, url), 401)
    assert "not accepted" in error_of(httpx.request(method, url, headers=bearer(WRONG_KEY)), 403)
    ok = httpx.request(method, url, headers=bearer(API_KEYS[1]))
    assert ok.status_code in (200, 404), ok.text
    assert ok.status_code == 200 or "no_such_model" in path


def test_inference_needs_a_key(secured: RunningServer) -> None:
    url = secured.url + "/v2/models/echo/infer"
    assert error_of(httpx.post(url, json=ECHO), 401)
    assert error_of(httpx.post(url, json=ECHO, headers=bearer(WRONG_KEY)), 403)
    assert error_of(httpx.post(url, json=ECHO, headers=bearer(ADMIN_KEY)), 403)
    for key in API_KEYS:
        r = httpx.post(url, json=ECHO, headers=bearer(key))
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == [2, 4, 6, 8]


@pytest.mark.parametrize(
    ("authorization", "status"),
    [
        (f"Basic {API_KEYS[0]}", 401),
        ("Bearer", 401),
        ("Bearer    ", 401),
        (f"bearer {API_KEYS[0]}", 200),
        (f"Bearer  {API_KEYS[0]} ", 200),
        (f"Bearer {API_KEYS[0]}x", 403),
        (f"Bearer {API_KEYS[0][:-1]}", 403),
        ("Bearer caf\xe9", 403),  # non-ASCII key: compared as bytes, not a 500
        ("Bearer \xff\xfe\x80", 403),
    ],
)
def test_authorization_header_forms(
    secured: RunningServer, authorization: str, status: int
) -> None:
    data = request_bytes("GET", "/v2/models/echo", b"", f"Authorization: {authorization}")
    response = exchange(secured, data)
    assert response.status == status, response.body[:200]
    if status != 200:
        response.error()


@pytest.mark.parametrize(
    "path",
    [
        "//v2//models/echo/infer",
        "/v2/models//echo/infer",
        "/v2/models/echo/infer/",
        "/v2//models/stats",
    ],
)
def test_odd_slashes_do_not_skip_authentication(secured: RunningServer, path: str) -> None:
    response = exchange(secured, request_bytes("POST", path, b"{}"))
    assert response.status in (401, 404), response.body[:200]


# -- admin keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v2/repository/models/echo/unload",
        "//v2/repository/models/echo/unload",
        "/v2//repository//models/echo/unload/",
        "/v2/repository/models/echo/load",
    ],
)
def test_model_control_needs_the_admin_key(secured: RunningServer, path: str) -> None:
    url = secured.url + path
    assert error_of(httpx.post(url), 401)
    for key in (*API_KEYS, WRONG_KEY):
        assert "model management" in error_of(httpx.post(url, headers=bearer(key)), 403)
    assert (
        httpx.post(
            secured.url + "/v2/models/echo/infer", json=ECHO, headers=bearer(API_KEYS[0])
        ).status_code
        == 200
    )


@pytest.mark.parametrize(
    "path",
    [
        "/v2/logging",
        "/v2/trace/setting",
        "/v2/models/echo/trace/setting",
        "//v2/models/echo//trace/setting/",
    ],
)
def test_changing_log_and_trace_settings_needs_the_admin_key(
    secured: RunningServer, path: str
) -> None:
    url = secured.url + path
    assert error_of(httpx.post(url, json={}), 401)
    for key in (*API_KEYS, WRONG_KEY):
        answer = httpx.post(url, json={}, headers=bearer(key))
        assert "log and trace settings" in error_of(answer, 403)
    assert httpx.get(url, headers=bearer(API_KEYS[0])).status_code == 200  # reading: any key
    assert httpx.post(url, json={}, headers=bearer(ADMIN_KEY)).status_code == 200


def test_admin_key_unloads_and_loads(secured: RunningServer) -> None:
    admin = bearer(ADMIN_KEY)
    infer = secured.url + "/v2/models/echo/infer"
    r = httpx.post(secured.url + "/v2/repository/models/echo/unload", headers=admin)
    assert r.status_code == 200, r.text
    assert httpx.post(infer, json=ECHO, headers=bearer(API_KEYS[0])).status_code in (404, 503)
    r = httpx.post(secured.url + "/v2/repository/models/echo/load", headers=admin, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(infer, json=ECHO, headers=bearer(API_KEYS[0])).status_code == 200


@pytest.mark.parametrize(
    ("name", "statuses"),
    [
        ("..", (400,)),
        (".hidden", (400,)),
        ("a%00b", (400,)),
        ("..%2Fx", (401, 403, 404)),
        ("no_such_model", (404,)),
    ],
)
def test_load_refuses_unsafe_or_unknown_names(
    secured: RunningServer, name: str, statuses: tuple[int, ...]
) -> None:
    path = f"/v2/repository/models/{name}/load"
    response = exchange(
        secured, request_bytes("POST", path, b"", f"Authorization: Bearer {ADMIN_KEY}")
    )
    assert response.status in statuses, response.body[:300]
    response.error()


# -- the repository boundary ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["escape", "linked"])
def test_symlinks_out_of_the_repository_are_refused(
    secured: RunningServer, outside: Path, name: str
) -> None:
    key = bearer(API_KEYS[0])
    ready = httpx.get(secured.url + f"/v2/models/{name}/ready", headers=key)
    assert ready.status_code in (404, 503)
    r = httpx.post(secured.url + f"/v2/models/{name}/infer", json=ECHO, headers=key)
    assert r.status_code in (404, 503)
    load = httpx.post(secured.url + f"/v2/repository/models/{name}/load", headers=bearer(ADMIN_KEY))
    assert "outside" in error_of(load, 400)
    index = httpx.post(secured.url + "/v2/repository/index", headers=key).json()
    states = {entry["name"]: entry["state"] for entry in index}
    assert states.get(name, "UNAVAILABLE") == "UNAVAILABLE"
    assert not (outside / "1" / "EXECUTED").exists(), "code outside the repository was run"


# -- limits ------------------------------------------------------------------------------


def test_body_limit_declared(secured: RunningServer) -> None:
    body = b"[" + b"0," * (600 * 1024) + b"0]"  # 1.2 MB over the 1 MB limit
    r = httpx.post(secured.url + "/v2/models/echo/infer", content=body, headers=bearer(API_KEYS[0]))
    assert "limit" in error_of(r, 413)


def test_body_limit_chunked(secured: RunningServer) -> None:
    head = request_bytes(
        "POST",
        "/v2/models/echo/infer",
        b"",
        "Transfer-Encoding: chunked",
        f"Authorization: Bearer {API_KEYS[0]}",
    )
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b" " * 64 * 1024)
    with socket.create_connection(("127.0.0.1", secured.port), timeout=10) as sock:
        sock.sendall(head)
        try:
            for _ in range(64):  # 4 MB, unless the server answers first
                sock.sendall(chunk)
        except OSError:
            pass
        response = read_response(sock)
    assert response.status == 413
    assert "limit" in response.error()


def test_requests_over_the_limit_get_503_at_once_and_probes_still_answer(
    secured: RunningServer,
) -> None:
    """LIMIT requests hold their places mid-body; a further request is refused at once, while
    health probes, which the limit never counts against, still answer."""
    partial = request_bytes(
        "POST",
        "/v2/models/echo/infer",
        b"{",
        "Content-Length: 100",
        f"Authorization: Bearer {API_KEYS[0]}",
    )
    holders = [
        socket.create_connection(("127.0.0.1", secured.port), timeout=10) for _ in range(LIMIT)
    ]
    try:
        for sock in holders:
            sock.sendall(partial)
        time.sleep(0.3)
        for _ in range(3):
            started = time.monotonic()
            refused = exchange(
                secured,
                request_bytes(
                    "POST",
                    "/v2/models/echo/infer",
                    b"{}",
                    "Content-Length: 2",
                    f"Authorization: Bearer {API_KEYS[0]}",
                ),
            )
            assert refused.status == 503
            assert time.monotonic() - started < 2
            assert exchange(secured, request_bytes("GET", "/v2/health/live")).status == 200
            assert exchange(secured, request_bytes("GET", "/v2/health/ready")).status == 200
        for sock in holders:  # the held requests were admitted: they complete, malformed
            sock.sendall(b" " * 99)
            assert read_response(sock).status == 400
    finally:
        for sock in holders:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(secured.url + "/v2/health/live").status_code == 200


def test_a_full_server_takes_places_back_from_bodies_that_do_not_come(
    secured: RunningServer,
) -> None:
    """One client (127.0.0.2) sends LIMIT complete heads and stalls their bodies, on the
    parser's path (chunked) and on the lane's (Content-Length), so it holds every place. Once
    they have waited past --slow-body-secs (1 s), each request from another client takes the
    place of the stalled client's oldest request, which gets 503 with Retry-After and a
    closed connection; the requests stalled after them, younger, are not taken back."""
    auth = f"Authorization: Bearer {API_KEYS[0]}"
    chunked = (
        request_bytes("POST", "/v2/models/echo/infer", b"", "Transfer-Encoding: chunked", auth)
        + b"a\r\n{"
    )
    lane = request_bytes("POST", "/v2/models/echo/infer", b"{", "Content-Length: 100", auth)

    def stall(data: bytes) -> socket.socket:
        sock = socket.create_connection(
            ("127.0.0.1", secured.port), timeout=10, source_address=("127.0.0.2", 0)
        )
        sock.sendall(data)
        time.sleep(0.05)  # in this order
        return sock

    complete = request_bytes("POST", "/v2/models/echo/infer", b"{}", "Content-Length: 2", auth)
    holders = [stall(chunked if i % 2 == 0 else lane) for i in range(LIMIT)]
    try:
        time.sleep(1.2)
        for oldest in holders[:2]:  # the parser's, then the lane's
            answered = exchange(secured, complete)
            assert answered.status == 400  # in a place taken back: answered by the model route
            refused = read_response(oldest)
            assert refused.status == 503 and int(refused.headers["retry-after"]) >= 1
            assert oldest.recv(1) == b""  # closed, the rest of its body unread
            holders.append(stall(lane))  # the freed place, taken again by a young request
        for young in holders[LIMIT:]:  # taken after the others, so never the oldest: open
            young.setblocking(False)
            with pytest.raises(BlockingIOError):
                young.recv(1)
    finally:
        for sock in holders:
            sock.close()
    metrics = httpx.get(secured.url + "/metrics", headers=bearer(API_KEYS[0])).text
    assert 'lockgate_http_refused_total{reason="slow_body"} 2.0' in metrics


# -- the log -------------------------------------------------------------------------------


def test_keys_never_reach_the_log(secured: RunningServer) -> None:
    url = secured.url + "/v2/models/echo/infer"
    for key in (*API_KEYS, ADMIN_KEY, WRONG_KEY):
        httpx.post(url, json=ECHO, headers=bearer(key))
        httpx.post(url, content=b"{bad json", headers=bearer(key))
        httpx.post(secured.url + "/v2/repository/models/no_such/load", headers=bearer(key))
    log = secured.log()
    assert "lockgate listening" in log
    for key in (*API_KEYS, ADMIN_KEY, WRONG_KEY):
        assert key not in log
    assert "Traceback" not in log


def test_model_control_is_off_by_default(server: RunningServer) -> None:
    """Without --model-control-mode explicit, nobody loads or unloads models over HTTP."""
    for action in ("load", "unload"):
        r = httpx.post(server.url + f"/v2/repository/models/digits_onnx/{action}", timeout=30)
        assert "--model-control-mode explicit" in error_of(r, 403)
    assert httpx.get(server.url + "/v2/models/digits_onnx/ready", timeout=10).status_code == 200
