"""Triton's log settings as bookkeeping: changes applied whole, nulls left alone, every
refusal named."""

from __future__ import annotations

import pytest

from lockgate.errors import BadRequest
from lockgate.protocol.log_settings import MAX_VERBOSE_LEVEL, LogSettings, decode_settings


def test_document_is_tritons() -> None:
    assert LogSettings().document() == {
        "log_file": "",
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "default",
    }


def test_a_change_names_some_settings_and_null_leaves_one_alone() -> None:
    changed = LogSettings().changed(
        {"log_info": False, "log_verbose_level": 3, "log_format": "ISO8601", "log_error": None}
    )
    assert changed == LogSettings(log_info=False, log_verbose_level=3, log_format="ISO8601")
    assert changed.verbose
    assert LogSettings().changed({"log_file": None}) == LogSettings()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"log_file": "/tmp/lockgate.log"}, "log_file cannot be changed at run time"),
        ({"log_file": ""}, "log_file cannot be changed at run time"),
        ({"log_info": "yes"}, "log_info must be true or false"),
        ({"log_warning": 1}, "log_warning must be true or false"),
        ({"log_verbose_level": -1}, f"log_verbose_level must be 0 to {MAX_VERBOSE_LEVEL}"),
        ({"log_verbose_level": MAX_VERBOSE_LEVEL + 1}, "log_verbose_level must be 0 to"),
        ({"log_verbose_level": True}, "log_verbose_level must be an integer"),
        ({"log_verbose_level": "1"}, "log_verbose_level must be an integer"),
        ({"log_format": "json"}, "log_format must be one of default, ISO8601, got 'json'"),
        ({"log_format": 2}, "log_format must be one of"),
        ({"log_warnings": True}, "unknown log setting 'log_warnings'"),
    ],
)
def test_refusals_apply_nothing(change: dict[str, object], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        LogSettings().changed({"log_info": False, **change})


@pytest.mark.parametrize(
    ("body", "message"),
    [(b"[1]", "must be a JSON object"), (b"{", "malformed JSON"), (b'"x"', "JSON object")],
)
def test_bodies(body: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        decode_settings(body)
    assert decode_settings(b" ") == {}
