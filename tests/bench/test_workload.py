import json

import numpy as np
import pytest

from lockgate.bench.workload import (
    load_shared_workload,
    openai_payloads,
    read_jsonl,
    synthesize_v2_body,
    synthetic_prompts,
)
from lockgate.errors import BadRequest

METADATA = {
    "inputs": [
        {"name": "x", "datatype": "FP32", "shape": [-1, 4]},
        {"name": "b", "datatype": "BOOL", "shape": [-1, 2, -1]},
        {"name": "s", "datatype": "BYTES", "shape": [-1]},
    ]
}


def test_v2_body_follows_the_metadata() -> None:
    body = json.loads(synthesize_v2_body(METADATA, 3, np.random.default_rng(0)))
    x, b, s = body["inputs"]
    assert x["shape"] == [3, 4] and len(x["data"]) == 12 and x["datatype"] == "FP32"
    assert all(isinstance(v, float) for v in x["data"])
    assert b["shape"] == [3, 2, 1] and all(isinstance(v, bool) for v in b["data"])
    assert s["shape"] == [3] and all(isinstance(v, str) for v in s["data"])


def test_bad_metadata_and_files_are_clear_errors(tmp_path) -> None:
    with pytest.raises(BadRequest, match="datatype"):
        synthesize_v2_body(
            {"inputs": [{"name": "x", "datatype": "F7", "shape": [1]}]}, 1, np.random.default_rng(0)
        )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(BadRequest, match=r"bad\.jsonl:2"):
        read_jsonl(bad)
    with pytest.raises(BadRequest, match="prompt_ids"):
        load_shared_workload(bad)


def test_openai_bodies_stream_with_usage() -> None:
    prompts = synthetic_prompts(20, seed=1, min_words=3, max_words=30)
    lengths = [len(p.split()) for p in prompts]
    assert min(lengths) >= 3 and max(lengths) <= 30 and len(set(lengths)) > 5
    assert prompts == synthetic_prompts(20, seed=1, min_words=3, max_words=30)
    payloads = openai_payloads("openai-chat", "m", prompts[:2], [16, 16], ignore_eos=True)
    body = json.loads(payloads[0].body)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"][0]["content"] == prompts[0] and body["ignore_eos"] is True
    assert payloads[0].max_tokens == 16
    with pytest.raises(BadRequest, match="text prompts"):
        openai_payloads("openai-chat", "m", [[1, 2]], [4], ignore_eos=False)
