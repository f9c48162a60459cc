"""Canaries on the OpenAI routes, through `lockgate route` and the openai client: by version
(the router names it in `x-lockgate-model-version`) and by replica group."""

from __future__ import annotations

import concurrent.futures
import textwrap
from collections import Counter
from collections.abc import Iterator

import openai
import pytest

from tests.conftest import RunningServer, launch_server, start_servers
from tests.router.test_rollout import sample, within
from tests.router.test_router import start_router

VEC = '''
from pathlib import Path
import numpy as np

class Model:
    """An embedding model whose vector says who made it: [version, replica]."""

    def load(self, config, version_dir):
        self.vector = [float(Path(version_dir).name), float(config.parameters["replica"])]

    def infer(self, inputs):
        rows = inputs["text"].shape[0]
        return {
            "embedding": np.tile(np.array(self.vector, dtype=np.float32), (rows, 1)),
            "token_count": np.ones((rows, 1), dtype=np.int64),
        }
'''

VEC_CONFIG = """\
backend: python
max_batch_size: 8
inputs: [{name: text, datatype: BYTES, dims: [1]}]
outputs:
  - {name: embedding, datatype: FP32, dims: [2]}
  - {name: token_count, datatype: INT64, dims: [1]}
version_policy: {all: {}}
"""


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningServer]]:
    """Two replicas serving `vec` at versions 1 and 2."""
    root = tmp_path_factory.mktemp("openai-canary")
    servers = []
    for replica in range(2):
        folder = root / f"replica-{replica}" / "vec"
        for version in (1, 2):
            (folder / str(version)).mkdir(parents=True)
            (folder / str(version) / "model.py").write_text(VEC)
        text = VEC_CONFIG + f"parameters: {{replica: '{replica}'}}\n"
        (folder / "config.yaml").write_text(textwrap.dedent(text))
        servers.append(launch_server(folder.parent, root))
    start_servers(*servers)
    yield servers
    for server in servers:
        server.stop()


def client_of(router: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0, timeout=60)


def test_embeddings_canaries_by_version_and_group_follow_their_weights(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> None:
    r0, r1 = (r.url for r in replicas)
    router = start_router(
        tmp_path_factory.mktemp("openai-canary-router"),
        *("--replica", r0, "--replica", r1 + "#canary", "--no-hedge"),
        *("--canary", "vec:1=20", "--canary", "vec:#canary=20"),
    )
    try:
        client = client_of(router)

        def embed(headers: dict[str, str] | None = None) -> tuple[int, int]:
            answer = client.embeddings.create(model="vec", input="hi", extra_headers=headers)
            version, replica = answer.data[0].embedding
            return int(version), int(replica)

        n = 200
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = Counter(pool.map(lambda _: embed(), range(n)))
        pinned = Counter(embed({"x-lockgate-model-version": "2"}) for _ in range(20))
        counted = sample(router.url, "lockgate_router_model_requests_total", model="vec")
        version_1 = sample(router.url, "lockgate_router_model_requests_total", version="1")
    finally:
        router.stop()
    on_version_1 = sum(c for (v, _), c in answers.items() if v == 1)
    on_canary = sum(c for (_, r), c in answers.items() if r == 1)
    assert within(on_version_1, n, 0.20), answers  # 40 +- 4 sigma (22.6)
    assert within(on_canary, n, 0.20), answers
    assert all(r == 0 for (v, r) in answers if v == 1)  # a version canary stays on main
    assert all(v == 2 for (v, r) in answers if r == 1)  # the group serves the newest version
    assert all(v == 2 for v, _ in pinned)  # a request that names its version keeps it
    assert counted == n + 20 and version_1 == on_version_1


def test_completion_canaries_by_version(
    llm_server: RunningServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Half of the chat requests go to version 9, which the replica does not have (404); the
    others to the newest, version 1. A client's own version header is passed on."""
    model = "SmolLM2-135M-Instruct"
    router = start_router(
        tmp_path_factory.mktemp("openai-canary-llm"),
        *("--replica", llm_server.url, "--no-hedge", "--canary", f"{model}:9=50"),
    )
    try:
        client = client_of(router)

        def chat(headers: dict[str, str] | None = None) -> str:
            try:
                client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=1,
                    extra_headers=headers,
                )
            except openai.APIStatusError as exc:
                return f"{exc.status_code} {exc.message}"
            return "200"

        n = 40
        outcomes = Counter(chat() for _ in range(n))
        pinned = [chat({"x-lockgate-model-version": "1"}) for _ in range(6)]
        bad = chat({"x-lockgate-model-version": "first"})
    finally:
        router.stop()
    missing = [o for o in outcomes if o.startswith("404")]
    assert set(outcomes) == {"200", *missing} and len(missing) == 1, outcomes
    assert "unknown version 9" in missing[0]
    assert within(outcomes[missing[0]], n, 0.5), outcomes  # 20 +- 4 sigma (12.6)
    assert pinned == ["200"] * 6  # pinned to version 1: no canary drawn
    assert bad.startswith("400") and "x-lockgate-model-version" in bad, bad
