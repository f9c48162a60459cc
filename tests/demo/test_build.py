from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lockgate.backends.base import Backend, get_factory
from lockgate.core.repository import ModelEntry, scan_repository
from lockgate.demo.build import (
    DEMO_MODELS,
    DEMO_VERSION,
    MINILM_TOKENIZER_PACKAGE,
    DemoModel,
    build_demo_repository,
    default_demo_path,
    train_digits,
)
from lockgate.demo.packages import package_folder

SENTENCES = [
    "The cat sits on the mat.",
    "A fast inference server for CPUs.",
    "Quantum chromodynamics describes the strong interaction between quarks and gluons.",
    "hello",
    "Ich habe heute keine Zeit, weil es in Hamburg regnet.",
]


@pytest.fixture(scope="session")
def demo_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    messages: list[str] = []
    root = build_demo_repository(tmp_path_factory.mktemp("demo"), progress=messages.append)
    assert any("digits_onnx: done" in m for m in messages)
    return root


@pytest.fixture(scope="session")
def entries(demo_repository: Path) -> dict[str, ModelEntry]:
    return {entry.name: entry for entry in scan_repository(demo_repository)}


def open_backend(demo_repository: Path, entry: ModelEntry) -> Backend:
    assert entry.config is not None
    return get_factory(entry.config.backend)(entry.config, demo_repository / entry.name / "1")


@pytest.fixture(scope="session")
def minilm(demo_repository: Path, entries: dict[str, ModelEntry]) -> Iterator[Backend]:
    backend = open_backend(demo_repository, entries["minilm"])
    yield backend
    backend.close()


def test_every_demo_model_scans_clean(entries: dict[str, ModelEntry]) -> None:
    assert set(entries) == {model.name for model in DEMO_MODELS}
    for entry in entries.values():
        assert entry.ok, entry.error
        assert entry.versions == [1]


def test_rebuild_skips_built_models(demo_repository: Path) -> None:
    model_file = demo_repository / "digits_onnx" / "1" / "model.onnx"
    before = model_file.stat().st_mtime_ns
    messages: list[str] = []
    build_demo_repository(demo_repository, progress=messages.append)
    assert all("already built" in m for m in messages) and len(messages) == len(DEMO_MODELS)
    assert model_file.stat().st_mtime_ns == before


@pytest.mark.parametrize("name", ["digits_onnx", "digits_sklearn"])
def test_digits_accuracy(demo_repository: Path, entries: dict[str, ModelEntry], name: str) -> None:
    data = train_digits()
    backend = open_backend(demo_repository, entries[name])
    labels, probabilities = [], []
    for start in range(0, len(data.features), 64):  # max_batch_size rows at a time
        out = backend.infer({"input": data.features[start : start + 64]})
        labels.append(out["label"])
        probabilities.append(out["probabilities"])
    predicted = np.concatenate(labels)
    assert predicted.dtype == np.int64 and predicted.shape == data.labels.shape
    assert (predicted == data.labels).mean() > 0.9
    np.testing.assert_allclose(np.concatenate(probabilities).sum(axis=1), 1.0, atol=1e-5)
    backend.close()


def reference_embeddings(sentences: list[str]) -> np.ndarray:
    """fp32 all-MiniLM-L6-v2 with transformers, mean-pooled and normalized: [N, 384]."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModel

    folder = package_folder(MINILM_TOKENIZER_PACKAGE) / "model"
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_truncation(256)
    tokenizer.enable_padding()
    encodings = tokenizer.encode_batch(sentences)
    ids = torch.tensor([e.ids for e in encodings])  # [N, T]
    mask = torch.tensor([e.attention_mask for e in encodings])  # [N, T]
    model = AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.inference_mode():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [N, T, 384]
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return torch.nn.functional.normalize(pooled, dim=1).numpy()


def text_batch(sentences: list[str]) -> np.ndarray:
    return np.array([[s.encode()] for s in sentences], dtype=object)  # [B, 1] BYTES


def test_minilm_matches_fp32_reference(minilm: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = minilm.infer({"text": text_batch(SENTENCES)})["embedding"]
    assert out.shape == (len(SENTENCES), 384) and out.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    cosine = (out * reference_embeddings(SENTENCES)).sum(axis=1)
    assert cosine.min() >= 0.98, cosine


def test_minilm_batching_and_semantics(minilm: Backend) -> None:
    alone = minilm.infer({"text": text_batch(SENTENCES[:1])})["embedding"]
    batched = minilm.infer({"text": text_batch(SENTENCES)})["embedding"]
    assert float(alone[0] @ batched[0]) > 0.99  # padding to the longest does not change it
    pair = minilm.infer({"text": text_batch(["A cat on a rug.", "Stock prices fell sharply."])})
    similar, unrelated = pair["embedding"] @ batched[0]
    assert similar > unrelated + 0.2


def test_minilm_truncates_long_text(minilm: Backend) -> None:
    long_text = " ".join(["word"] * 2000)
    out = minilm.infer({"text": text_batch([long_text, "short"])})
    assert np.isfinite(out["embedding"]).all()
    assert out["token_count"].tolist() == [[256], [3]]  # cut to max_tokens; [CLS] short [SEP]


def test_minilm_counts_the_tokens_of_each_text(minilm: Backend) -> None:
    from tokenizers import Tokenizer

    folder = package_folder(MINILM_TOKENIZER_PACKAGE) / "model"
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    counts = minilm.infer({"text": text_batch(SENTENCES)})["token_count"]
    assert counts.dtype == np.int64 and counts.shape == (len(SENTENCES), 1)
    assert counts.ravel().tolist() == [len(tokenizer.encode(s).ids) for s in SENTENCES]


def test_minilm_decodes_invalid_utf8_with_replacement(minilm: Backend) -> None:
    broken = minilm.infer({"text": np.array([[b"caf\xe9 ok"]], dtype=object)})["embedding"]
    replaced = minilm.infer({"text": np.array([["caf\ufffd ok".encode()]], dtype=object)})
    np.testing.assert_allclose(broken, replaced["embedding"], rtol=1e-5, atol=1e-6)


def test_default_demo_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LOCKGATE_CACHE_DIR", str(tmp_path))
    assert default_demo_path() == tmp_path / "demo-repository" / f"v{DEMO_VERSION}"
    monkeypatch.delenv("LOCKGATE_CACHE_DIR")
    assert default_demo_path().is_relative_to(Path.home() / ".cache" / "lockgate")


def test_failed_builder_leaves_nothing(tmp_path: Path) -> None:
    def explode(folder: Path, say: object) -> None:
        (folder / "1").mkdir()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_demo_repository(tmp_path, models=[DemoModel("broken", explode)])
    assert os.listdir(tmp_path) == []


def test_demo_compositions_through_a_server(
    demo_repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The ensemble embeds as `minilm` does; the cascade is as accurate as the forest it
    escalates to on the rows it escalates; the cached model answers a repeat from the cache."""
    import httpx
    import tritonclient.http as httpclient

    from tests.conftest import start_server

    server = start_server(demo_repository, tmp_path_factory.mktemp("demo-logs"), "--no-llm")
    client = httpclient.InferenceServerClient(server.address)
    try:
        text = np.array([[s.encode()] for s in SENTENCES], dtype=object)
        embeddings = {}
        for model in ("minilm", "minilm_ensemble"):
            inp = httpclient.InferInput("text", list(text.shape), "BYTES")
            inp.set_data_from_numpy(text)
            embeddings[model] = client.infer(model, [inp]).as_numpy("embedding")
        cosine = (embeddings["minilm"] * embeddings["minilm_ensemble"]).sum(axis=1)
        assert cosine.min() > 0.999

        data = train_digits()
        features, labels = data.features[:64], data.labels[:64]
        accuracy = {}
        for model in ("digits_onnx", "digits_large", "digits_cascade"):
            inp = httpclient.InferInput("input", list(features.shape), "FP32")
            inp.set_data_from_numpy(features)
            predicted = client.infer(model, [inp]).as_numpy("label")
            accuracy[model] = float((predicted.reshape(-1) == labels).mean())
        assert accuracy["digits_cascade"] >= accuracy["digits_onnx"] - 0.01
        metrics = httpx.get(server.url + "/metrics").text
        assert (
            'lockgate_cascade_rows_total{model="digits_cascade",stage="1",version="1"}' in metrics
        )

        body = {
            "inputs": [
                {
                    "name": "input",
                    "shape": [1, 64],
                    "datatype": "FP32",
                    "data": features[0].tolist(),
                }
            ]
        }
        url = server.url + "/v2/models/digits_cached/infer"
        httpx.post(url, json=body)
        assert httpx.post(url, json=body).headers.get("x-lockgate-cache") == "hit"

        # token ids the encoder cannot take are a 400 naming the problem, not the model's 500
        def tokens(ids: list[int], types: int = 0) -> dict[str, object]:
            return {
                "inputs": [
                    {"name": name, "shape": [1, len(ids)], "datatype": "INT64", "data": data}
                    for name, data in (
                        ("input_ids", ids),
                        ("attention_mask", [1] * len(ids)),
                        ("token_type_ids", [types] * len(ids)),
                    )
                ]
            }

        encoder = server.url + "/v2/models/minilm_encoder/infer"
        assert httpx.post(encoder, json=tokens([101, 2023, 102])).status_code == 200
        for bad, says in (
            (tokens([101, 10**9, 102]), "token ids in 0..30521"),
            (tokens([101] * 513), "1 to 512 tokens"),
            (tokens([101, 102], types=7), "token_type_ids must hold 0 and 1"),
        ):
            answer = httpx.post(encoder, json=bad)
            assert answer.status_code == 400 and says in answer.json()["error"], answer.text
    finally:
        client.close()
        server.stop()
