"""The bounds on `n` and `best_of` in `OpenAILimits` (protocol/openai.py)."""

from __future__ import annotations

import pytest

from lockgate.errors import BadRequest
from lockgate.protocol import openai as oa


def test_sequences_of_a_completion_within_a_configured_limit() -> None:
    limits = oa.OpenAILimits(max_n=4)
    assert limits.sequences(3, None, stream=True) == 3
    assert limits.sequences(2, 4, stream=False) == 4
    assert limits.sequences(2, 2, stream=True) == 2  # best_of = n: nothing to rank
    for n, best_of, stream, named in [
        (5, None, False, "n must be between 1 and 4, got 5"),
        (0, None, False, "n must be between 1 and 4, got 0"),
        (3, 2, False, "best_of must be between n (3) and 4, got 2"),
        (1, 5, False, "best_of must be between n (1) and 4, got 5"),
        (1, 2, True, "best_of cannot be used with stream"),
    ]:
        with pytest.raises(BadRequest, match=named.replace("(", r"\(").replace(")", r"\)")):
            limits.sequences(n, best_of, stream)


def test_max_n_is_a_flag_of_at_least_one() -> None:
    with pytest.raises(ValueError, match="--max-n must be an integer of at least 1"):
        oa.OpenAILimits(max_n=0)


def test_best_of_is_a_completion_field_and_still_refused_on_chat() -> None:
    completion = oa.decode(b'{"prompt": "p", "best_of": 3, "n": 2}', oa.CompletionRequest)
    assert completion.best_of == 3 and completion.unsupported() is None
    with pytest.raises(BadRequest, match="best_of"):
        oa.decode(b'{"prompt": "p", "best_of": "3"}', oa.CompletionRequest)
    chat = oa.decode(b'{"messages": [], "best_of": 3}', oa.ChatRequest)
    assert chat.unsupported() == "best_of"
