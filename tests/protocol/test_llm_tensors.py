"""A language model's v2 tensors, as Triton's vLLM backend reads them: flags, the sampling
fields from the sampling_parameters input or the request's parameters, and the outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lockgate.errors import BadRequest
from lockgate.protocol import llm_tensors


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=object)


def flag(value: bool) -> np.ndarray:
    return np.array([value], dtype=bool)


def test_sampling_parameters_read_as_the_vllm_backend_reads_them() -> None:
    inputs = {
        "text_input": text("Hello"),
        "stream": flag(True),
        # the vLLM backend's sample client sends its numbers as strings
        "sampling_parameters": text(json.dumps({"temperature": "0.1", "max_tokens": "100"})),
        "return_finish_reason": flag(True),
        "return_num_output_tokens": flag(False),
    }
    asked = llm_tensors.decode(inputs, {"max_tokens": 5})  # the tensor wins over parameters
    assert asked.text_input == "Hello"
    assert asked.completion.temperature == 0.1
    assert asked.completion.max_tokens == 100
    assert asked.stream and not asked.prepend_input
    assert asked.returns == frozenset({"finish_reason"})


def test_request_parameters_stand_in_for_a_missing_sampling_tensor() -> None:
    parameters = {"max_tokens": 7, "top_k": "3", "ignore_eos": "true", "timeout": 10_000}
    asked = llm_tensors.decode({"text_input": text("Hi")}, parameters)
    assert (asked.completion.max_tokens, asked.completion.top_k) == (7, 3)
    assert asked.completion.ignore_eos is True
    assert not asked.stream and asked.prepend_input  # the whole text, prompt first


def test_exclude_input_in_output_as_the_backend_decides() -> None:
    base = {"text_input": text("Hi")}
    assert not llm_tensors.decode({**base, "exclude_input_in_output": flag(True)}, {}).prepend_input
    with pytest.raises(BadRequest, match="not allowed with stream true"):
        llm_tensors.decode(
            {**base, "stream": flag(True), "exclude_input_in_output": flag(False)}, {}
        )


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ("{not json", "sampling_parameters is not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"temperature": 0, "beam_width": 4}', "unknown sampling parameters: 'beam_width'"),
        ('{"max_tokens": "many"}', "max_tokens must be a number"),
        ('{"top_p": [1]}', "invalid sampling parameters"),
        ('{"stop": "' + "x" * 70_000 + '"}', "sampling_parameters is over 65536 bytes"),
    ],
    ids=["malformed", "not an object", "unknown", "not a number", "wrong type", "too long"],
)
def test_bad_sampling_parameters_are_named(sampling: str, message: str) -> None:
    inputs = {"text_input": text("Hi"), "sampling_parameters": text(sampling)}
    with pytest.raises(BadRequest, match=message):
        llm_tensors.decode(inputs, {})


def test_outputs_carry_what_the_flags_ask() -> None:
    piece = llm_tensors.Piece("é", None, 4, 1, -0.5)
    plain = llm_tensors.outputs(piece, frozenset())
    assert list(plain) == ["text_output"]
    assert plain["text_output"][0] == "é".encode()
    every = llm_tensors.outputs(piece, frozenset(llm_tensors.RETURNS.values()))
    assert every["finish_reason"][0] == b"None"  # unfinished, as the backend writes it
    assert every["num_input_tokens"].dtype == np.uint32 and every["num_input_tokens"][0] == 4
    assert every["cumulative_logprob"].dtype == np.float32
    assert {spec.name for spec in llm_tensors.OUTPUTS} == set(every)
