"""A model's sampling defaults (`llm/generation_config.py`): read from generation_config.json,
and merged under the values a request gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockgate.errors import ConfigError
from lockgate.llm.generation_config import GenerationDefaults, read_generation_defaults
from lockgate.llm.sequence import SamplingParams


def write(folder: Path, raw: object) -> Path:
    (folder / "generation_config.json").write_text(json.dumps(raw))
    return folder


def test_without_a_file_the_defaults_are_the_openai_apis(tmp_path: Path) -> None:
    defaults = read_generation_defaults(tmp_path)
    assert defaults == GenerationDefaults()
    assert defaults.fill(None, None, None, None) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }


def test_the_file_sets_what_it_names_and_ignores_the_rest(tmp_path: Path) -> None:
    raw = {"temperature": 0.6, "top_p": 0.9, "top_k": None, "do_sample": True, "eos_token_id": 2}
    defaults = read_generation_defaults(write(tmp_path, raw))
    assert defaults.to_dict() == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    assert defaults.source.endswith("generation_config.json")


def test_a_value_the_request_gives_wins_over_the_default() -> None:
    defaults = GenerationDefaults(temperature=0.0, top_p=0.9, top_k=50, min_p=0.05)
    filled = defaults.fill(0.7, None, 0, None)  # top_k 0 given: off, not the default 50
    assert filled == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": 0.05,
        "repetition_penalty": 1.0,
    }
    params = SamplingParams(**filled, max_tokens=4)
    assert not params.is_greedy and params.top_k == 0
    assert SamplingParams(**defaults.fill(None, None, None, None)).is_greedy


def test_the_files_repetition_penalty_is_the_default_as_in_vllm(tmp_path: Path) -> None:
    defaults = read_generation_defaults(write(tmp_path, {"repetition_penalty": 1.05}))
    assert defaults.fill(None, None, None, None)["repetition_penalty"] == 1.05
    assert defaults.fill(None, None, None, None, 1.0)["repetition_penalty"] == 1.0  # asked


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"temperature": "low"}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": True}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ([0.7], "<file>"),
    ],
)
def test_a_bad_file_is_a_config_error_naming_the_file_and_field(
    tmp_path: Path, raw: object, field: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        read_generation_defaults(write(tmp_path, raw))
    assert caught.value.field == field
    assert caught.value.path.endswith("generation_config.json")
