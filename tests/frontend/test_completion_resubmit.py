"""A completion whose model version began draining between being resolved and being
submitted (a reload swapped the new version in meanwhile) starts over once on the version now
serving (`CompletionPipeline.resubmitted`). The race itself runs through a real server in
`test_llm_lifecycle.py`; here each branch of the decision, deterministically."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from lockgate.config import ModelConfig
from lockgate.core.metrics import Registry
from lockgate.errors import Unavailable
from lockgate.frontend.completion_pipeline import CompletionPipeline, PreparedCompletion, Superseded
from lockgate.frontend.http import HttpRequest
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.sequence import SamplingParams
from lockgate.llm.service import LLMService
from lockgate.protocol.openai import OpenAILimits


class Engine:
    """An engine that is serving, or draining (refusing as AsyncLLMEngine does)."""

    def __init__(self, draining: bool) -> None:
        self.draining = draining
        self.submitted = 0

    def generate_choices(self, *args: Any) -> object:
        if self.draining:
            raise Unavailable("the language model is draining", retry_after=1)
        self.submitted += 1
        return object()


def service(engine: Engine) -> LLMService:
    """A version of the model served as `smollm2-served`, over `engine`."""
    config = ModelConfig(name="smollm2", backend="llm")
    tokenizer: Any = None  # submit does not tokenize
    return LLMService("smollm2-served", config, EngineConfig(), tokenizer, engine, 10, 0.0, 0)  # type: ignore[arg-type]


def pipeline(serving: list[LLMService]) -> CompletionPipeline:
    """A pipeline whose app serves `serving` (the versions ready now)."""
    models = SimpleNamespace(registry=Registry(), services=lambda: list(serving))
    settings = SimpleNamespace(openai=OpenAILimits())
    app: Any = SimpleNamespace(models=models, draining=False, cache=None, settings=settings)
    return CompletionPipeline(app)


def request() -> HttpRequest:
    async def receive() -> dict[str, Any]:
        return {}

    async def send(message: Any) -> None:
        return None

    return HttpRequest({"headers": []}, receive, send, "POST", "/v1/completions", 1 << 20)


def prepared(on: LLMService) -> PreparedCompletion:
    return PreparedCompletion(on, [1, 2, 3], SamplingParams(max_tokens=2), 1, None)


def refusals(p: CompletionPipeline) -> float:
    return p.rejected.values().get(("smollm2-served", "unavailable"), 0.0)


def test_a_superseded_version_is_submitted_again_on_the_one_now_serving() -> None:
    old, new = Engine(draining=True), Engine(draining=False)
    old_service, new_service = service(old), service(new)
    p = pipeline([new_service])
    resolved = [old_service, new_service]  # what each attempt resolves

    async def attempt() -> None:
        p.submit(request(), [prepared(resolved.pop(0))], "cmpl-1")

    asyncio.run(p.resubmitted(attempt))
    assert new.submitted == 1 and not resolved
    assert refusals(p) == 0  # served: no refusal to count


def test_a_draining_version_with_no_other_is_a_503_counted_once() -> None:
    old = Engine(draining=True)
    p = pipeline([])  # a shutdown or unload: nothing else serves the name
    calls = []

    async def attempt() -> None:
        calls.append(1)
        p.submit(request(), [prepared(service(old))], "cmpl-1")

    with pytest.raises(Unavailable) as refused_with:
        asyncio.run(p.resubmitted(attempt))
    assert not isinstance(refused_with.value, Superseded)
    assert calls == [1]  # not retried
    assert refusals(p) == 1


def test_superseded_twice_is_a_503_counted_once() -> None:
    p = pipeline([service(Engine(draining=False))])
    calls = []

    async def attempt() -> None:
        calls.append(1)
        p.submit(request(), [prepared(service(Engine(draining=True)))], "cmpl-1")

    with pytest.raises(Superseded):
        asyncio.run(p.resubmitted(attempt))
    assert calls == [1, 1]
    assert refusals(p) == 1
