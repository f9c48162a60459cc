"""Guided decoding (`llm/guided.py`) and its mask over the logits (`sampling.TokenMask`), on
SmolLM2's vocabulary and model."""

from __future__ import annotations

import json
import re
import statistics
import time

import pytest
import torch

from lockgate.errors import BadRequest
from lockgate.llm.engine import LLMEngine
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.guided import GrammarCompiler
from lockgate.llm.loader import Checkpoint
from lockgate.llm.models import allocate_kv_cache
from lockgate.llm.runner import CausalLM
from lockgate.llm.sampling import SamplingBatch, TokenMask
from lockgate.llm.sequence import FinishReason, SamplingParams, Sequence
from lockgate.llm.tokenizer import ChatTokenizer, IncrementalDetokenizer
from tests.llm.conftest import smollm2_engine

DIGITS = r"[0-9]+"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
SKY = ("red", "green", "blue")


def test_grammar_errors_name_the_field_and_the_problem(tokenizer: ChatTokenizer) -> None:
    grammars = tokenizer.grammars
    with pytest.raises(BadRequest, match=r"(?s)guided_regex: .*unclosed character class"):
        grammars.compile("regex", "[0-9", where="guided_regex")
    with pytest.raises(BadRequest, match=r"(?s)guided_grammar: .*unknown name"):
        grammars.compile("lark", "start: foo", where="guided_grammar")
    with pytest.raises(BadRequest, match=r"schema: .*Unimplemented keys: \[\"uniqueItems\"\]"):
        grammars.compile("json_schema", '{"type":"array","uniqueItems":true}', where="schema")
    lenient = grammars.compile("json_schema", '{"type":"array","uniqueItems":true}', strict=False)
    assert lenient.kind == "json_schema"


def test_a_tokenizer_llguidance_cannot_read_refuses_guided_requests() -> None:
    broken = GrammarCompiler('{"model": "not a tokenizer"}', [0])
    assert broken.problem is not None
    with pytest.raises(BadRequest, match="guided_json: guided decoding is not available"):
        broken.compile("json_schema", "{}", where="guided_json")


def test_grammars_compare_by_kind_and_source(tokenizer: ChatTokenizer) -> None:
    a = tokenizer.grammars.compile("regex", DIGITS)
    b = tokenizer.grammars.compile("regex", DIGITS)
    assert a == b and hash(a) == hash(b)  # the response cache's key sees the same request
    assert a != tokenizer.grammars.compile("lark", DIGITS.join(["start: /", "/"]))
    assert repr(a) == "Grammar(kind='regex', source='[0-9]+')"
    first, second = a.matcher(), a.matcher()  # each sequence its own place in the grammar
    first.advance(tokenizer.encode("1", add_special_tokens=False)[0])
    assert not first.is_complete and not second.is_complete


def test_a_mask_over_its_budget_ends_the_sequence(tokenizer: ChatTokenizer) -> None:
    within = tokenizer.grammars.compile("regex", DIGITS, mask_budget=10.0)
    over = tokenizer.grammars.compile("regex", DIGITS, mask_budget=1e-9)
    prompt = tokenizer.encode("n =")
    seqs = [Sequence.from_prompt(str(i), prompt, SamplingParams(grammar=g), 0.0)
            for i, g in enumerate((within, over))]  # fmt: skip
    TokenMask.build([s.matcher for s in seqs])
    assert [s.grammar_finish for s in seqs] == [None, FinishReason.LENGTH]
    seqs[0].append_token(tokenizer.encode("7", add_special_tokens=False)[0])
    assert seqs[0].grammar_finish is None  # digits may go on
    seqs[0].append_token(next(iter(tokenizer.eos_token_ids)))
    assert seqs[0].grammar_finish is FinishReason.STOP


def test_mask_keeps_only_allowed_tokens_and_leaves_other_rows_alone(
    tokenizer: ChatTokenizer,
) -> None:
    grammar = tokenizer.grammars.compile("regex", DIGITS)
    v = tokenizer.vocab_size + 5  # logits past the tokenizer's vocabulary are never allowed
    logits = torch.randn(3, v, generator=torch.Generator().manual_seed(0))
    mask = TokenMask.build([grammar.matcher(), None, grammar.matcher()])
    assert mask is not None
    out = mask.apply(logits)
    assert torch.equal(out[1], logits[1])
    assert torch.equal(torch.isfinite(out[0]), torch.isfinite(out[2]))
    allowed = torch.isfinite(out[0]).nonzero().squeeze(1).tolist()
    texts = [tokenizer.decode([t]) for t in allowed]
    assert allowed and all(t.isdigit() for t in texts), texts[:20]
    assert tokenizer.encode("7", add_special_tokens=False)[0] in allowed
    assert torch.equal(out[0][allowed], logits[0][allowed])
    assert not torch.isfinite(out[0][tokenizer.vocab_size :]).any()
    assert TokenMask.build([None, None]) is None
    params = [SamplingParams(), SamplingParams()]
    assert SamplingBatch.build(params, [[], []], [0, 0], v, [None, None]).mask is None


def real_engine(checkpoint: Checkpoint, model: CausalLM, tokenizer: ChatTokenizer) -> LLMEngine:
    config = EngineConfig(
        block_size=16,
        kv_cache_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=256,
        max_num_seqs=8,
    )
    return smollm2_engine(checkpoint, model, tokenizer, config)

    kv = allocate_kv_cache(checkpoint.config, 64, 16, "float32")
    return LLMEngine(
        model,
        kv,
        config,
        eos_token_ids=tokenizer.eos_token_ids,
        decoder_factory=lambda _prompt, skip: IncrementalDetokenizer(tokenizer, skip),
    )


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[str]:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    texts = dict.fromkeys(ids, "")
    reasons: dict[str, FinishReason | None] = {}
    while engine.has_unfinished:
        for out in engine.step():
            texts[out.request_id] += out.text
            reasons[out.request_id] = out.finish_reason
        engine.check_invariants()
    for i, (_, params) in enumerate(requests):
        if params.grammar is not None:  # ended by the grammar, not by max_tokens
            assert reasons[ids[i]] is FinishReason.STOP, texts[ids[i]]
    return [texts[i] for i in ids]


@pytest.mark.usefixtures("one_thread")
def test_constrained_and_unconstrained_rows_share_a_batch(
    checkpoint: Checkpoint, model: CausalLM, tokenizer: ChatTokenizer
) -> None:
    plain = (tokenizer.encode("The capital of France is"), SamplingParams(0.0, max_tokens=8))
    phone = SamplingParams(0.0, max_tokens=20, grammar=tokenizer.grammars.compile("regex", PHONE))
    (alone,) = run(real_engine(checkpoint, model, tokenizer), [plain])
    together = run(
        real_engine(checkpoint, model, tokenizer),
        [(tokenizer.encode("Call me at"), phone), plain, (tokenizer.encode("Phone:"), phone)],
    )
    assert together[1] == alone
    assert re.fullmatch(PHONE, together[0]) and re.fullmatch(PHONE, together[2]), together


@pytest.mark.usefixtures("one_thread")
def test_mask_cost_per_sequence_step(
    checkpoint: Checkpoint,
    model: CausalLM,
    tokenizer: ChatTokenizer,
    monkeypatch: pytest.MonkeyPatch,
    record_property: pytest.RecordProperty,
) -> None:
    """The time the masks add to a step, per constrained sequence: llguidance's mask
    (`TokenMask.build`) and its application to the logits (`TokenMask.apply`)."""
    spent = {"build": [], "apply": []}  # seconds per constrained row, one entry per step
    build, apply = TokenMask.build, TokenMask.apply

    def timed_build(matchers: list[object]) -> TokenMask | None:
        start = time.perf_counter()
        mask = build(matchers)  # type: ignore[arg-type]
        if mask is not None:
            spent["build"].append((time.perf_counter() - start) / len(mask.rows))
        return mask

    def timed_apply(self: TokenMask, logits: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = apply(self, logits)
        spent["apply"].append((time.perf_counter() - start) / len(self.rows))
        return out

    monkeypatch.setattr(TokenMask, "build", staticmethod(timed_build))
    monkeypatch.setattr(TokenMask, "apply", timed_apply)
    schema = (
        '{"type":"object","properties":{"color":{"enum":["red","green","blue"]},'
        '"count":{"type":"integer","minimum":0,"maximum":99}},"required":["color","count"],'
        '"additionalProperties":false}'
    )
    grammars = [
        tokenizer.grammars.compile("json_schema", schema),
        tokenizer.grammars.compile("regex", PHONE),
    ]
    requests = [
        (
            tokenizer.encode_chat([{"role": "user", "content": f"Give me example {i}."}]),
            SamplingParams(0.8, seed=i, max_tokens=48, grammar=grammars[i % 2]),
        )
        for i in range(8)
    ]
    texts = run(real_engine(checkpoint, model, tokenizer), requests)
    for i, text in enumerate(texts):
        assert re.fullmatch(PHONE, text) if i % 2 else json.loads(text)["color"] in SKY, text
    build_us = 1e6 * statistics.median(spent["build"])
    apply_us = 1e6 * statistics.median(spent["apply"])
    record_property("mask_us_per_sequence_step", round(build_us, 1))
    record_property("mask_apply_us_per_sequence_step", round(apply_us, 1))
    print(f"\nmask {build_us:.0f} µs + apply {apply_us:.0f} µs per sequence-step (median)")
    assert len(spent["build"]) == len(spent["apply"]) > 0
