"""Speculative decoding by prompt lookup: the proposer, the KV rollback, and the engine's
outputs with speculation against the same engine without it (fake models, then SmolLM2)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from lockgate.config import ModelConfig
from lockgate.errors import ConfigError
from lockgate.llm.engine import LLMEngine, RequestOutput
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.kv_cache import BlockManager
from lockgate.llm.loader import Checkpoint
from lockgate.llm.models import LlamaForCausalLM
from lockgate.llm.models import allocate_kv_cache as allocate_llama_kv_cache
from lockgate.llm.runner import CausalLM, RunnerOutput
from lockgate.llm.scheduler import SchedulerOutput
from lockgate.llm.sequence import FinishReason, SamplingParams, Sequence
from lockgate.llm.speculative import NgramProposer, num_accepted
from lockgate.llm.startup import engine_config_from
from lockgate.llm.tokenizer import ChatTokenizer, IncrementalDetokenizer
from tests.llm.conftest import smollm2_engine
from tests.llm.fake_model import VOCAB, FakeModel, LetterDecoder, allocate_kv_cache

BS = 4
PERIOD = 9  # the copy model repeats the token PERIOD positions back


def copy_next(context: list[int]) -> int:
    """The copy model's next token: the one PERIOD back, plus one at every 13th position (so
    some drafts are rejected)."""
    s = len(context)
    base = context[s - PERIOD] if s >= PERIOD else (7 * s + 3) % VOCAB
    return (base + 1) % VOCAB if s % 13 == 0 else base


class CopyModel(FakeModel):
    """FakeModel's cache discipline (token ids as keys, positions as values, checked on every
    read) with `copy_next` as its rule, applied to the context read back from the cache: a
    rejected draft left in the cache where a later token belongs changes the output."""

    def predict(self, keys: torch.Tensor, q: int) -> torch.Tensor:
        context = [int(t) for t in keys.tolist()]
        s = len(context)
        return torch.tensor([float(copy_next(context[: s - q + j + 1])) for j in range(q)])


def reference(rule: Callable[[list[int]], int], prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(rule(tokens))
    return tokens[len(prompt) :]


def make_engine(
    speculative: bool,
    model: FakeModel | None = None,
    blocks: int = 256,
    eos: tuple[int, ...] = (),
    **overrides: object,
) -> LLMEngine:
    settings: dict[str, object] = {
        "block_size": BS,
        "kv_cache_blocks": blocks,
        "max_model_len": 128,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 16,
        "speculative": "ngram" if speculative else "none",
    }
    settings.update(overrides)
    config = EngineConfig(**settings)  # type: ignore[arg-type]
    return LLMEngine(
        model or CopyModel(), allocate_kv_cache(blocks, BS), config, eos_token_ids=eos, seed=0
    )


def record_steps(engine: LLMEngine) -> list[SchedulerOutput]:
    """The scheduler outputs the runner is given, in order."""
    seen: list[SchedulerOutput] = []
    run = engine.runner.run

    def recording(out: SchedulerOutput) -> RunnerOutput:
        seen.append(out)
        return run(out)

    engine.runner.run = recording  # type: ignore[method-assign]
    return seen


def run_all(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[RequestOutput]]:
    """Every request's outputs, checking the KV allocator after every step: no block leaks, and
    a sequence holds no block past its tokens (none that only rejected drafts used)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    outputs: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    bm = engine.block_manager
    while engine.has_unfinished:
        for o in engine.step():
            outputs[o.request_id].append(o)
        engine.check_invariants()
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= bm.blocks_needed(seq.num_tokens)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
    return [outputs[i] for i in ids]


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def copy_prompts(n: int, seed: int, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(PERIOD, 30))] for _ in range(n)]


# -- the proposer ------------------------------------------------------------------------------


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest suffix first, latest earlier occurrence first."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


def test_proposer_takes_the_longest_suffix_then_the_latest_occurrence() -> None:
    proposer = NgramProposer(3, 2, 4)
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2], 10) == [3, 4, 5]
    # [7, 1, 2] (3 tokens) occurs at the start; [1, 2] also later: the longer one wins
    assert proposer.propose([7, 1, 2, 9, 5, 1, 2, 8, 7, 1, 2], 10) == [9, 5, 1]
    assert proposer.propose([1, 2, 3, 1, 2, 4, 1, 2], 10) == [4, 1, 2]  # the latest
    assert proposer.propose([3, 3, 3, 3], 10) == [3]  # overlapping the suffix
    assert proposer.propose([5, 1, 9, 1], 10) == []  # only [1]: shorter than min
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2], 2) == [3, 4]  # capped by the caller
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2], 0) == []
    assert proposer.propose([1, 2], 10) == []


@pytest.mark.parametrize(("k", "min_n", "max_n"), [(4, 2, 4), (1, 1, 1), (6, 1, 5), (3, 3, 3)])
def test_proposer_equals_brute_force(k: int, min_n: int, max_n: int) -> None:
    rng = random.Random(k * 100 + min_n * 10 + max_n)
    proposer = NgramProposer(k, min_n, max_n)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        assert proposer.propose(tokens, k) == brute_force(tokens, k, min_n, max_n), tokens


def test_num_accepted_is_the_matching_prefix() -> None:
    assert num_accepted([], [5]) == 0
    assert num_accepted([1, 2, 3], [1, 2, 3, 4]) == 3
    assert num_accepted([1, 2, 3], [1, 9, 3, 4]) == 1
    assert num_accepted([1, 2, 3], [0, 2, 3, 4]) == 0


# -- KV rollback -------------------------------------------------------------------------------


def test_trim_frees_the_blocks_of_rejected_drafts() -> None:
    bm = BlockManager(16, BS)
    seq = Sequence.from_prompt("s", list(range(10)), SamplingParams(), 0.0)
    bm.allocate(seq)  # 3 blocks for 10 tokens
    seq.num_computed_tokens = 9
    assert bm.can_append(seq, 6) and not bm.can_append(seq, 4 * 16)
    bm.may_append(seq, 6)  # positions up to 15: 4 blocks
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 12
    bm.trim(seq, 11)  # 11 tokens computed: 3 blocks
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 13
    bm.check_invariants([seq])
    bm.free(seq)
    assert bm.num_free_blocks == 16
    bm.check_invariants([])


# -- the engine with fake models ---------------------------------------------------------------


@pytest.mark.parametrize("blocks", [256, 30])
def test_greedy_outputs_equal_without_speculation(blocks: int) -> None:
    prompts = copy_prompts(16, seed=blocks)
    rng = random.Random(2)
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 60), ignore_eos=True)
        for _ in prompts
    ]
    plain = make_engine(False, blocks=blocks, max_model_len=96)
    spec = make_engine(True, blocks=blocks, max_model_len=96)
    steps = record_steps(spec)
    expected = [
        reference(copy_next, p, sp.max_tokens) for p, sp in zip(prompts, params, strict=True)
    ]
    assert [tokens_of(o) for o in run_all(plain, prompts, params)] == expected
    assert [tokens_of(o) for o in run_all(spec, prompts, params)] == expected
    s = spec.speculation
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # accepted and rejected drafts
    assert spec.stats().num_steps < plain.stats().num_steps
    assert spec.stats().generation_tokens == sum(sp.max_tokens for sp in params)
    if blocks == 30:
        assert spec.stats().num_preemptions > 0
    for out in steps:
        assert out.num_batched_tokens <= 32
        for s_ in out.scheduled:
            assert len(s_.draft_token_ids) <= 4
            # never computes past what max_tokens lets it emit (the drafts and the bonus)
            seq = s_.seq
            assert s_.start + s_.num_tokens + 1 <= seq.num_prompt_tokens + seq.params.max_tokens


def test_rejected_drafts_only_with_an_unpredictable_model() -> None:
    """FakeModel's next token is a hash of the context: drafts are proposed and rejected."""
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5, 6, 5]]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 2
    plain = run_all(make_engine(False, FakeModel()), prompts, params)
    engine = make_engine(True, FakeModel())
    assert [tokens_of(o) for o in run_all(engine, prompts, params)] == [tokens_of(o) for o in plain]
    assert engine.speculation.num_draft_tokens > 0


def test_eos_stop_tokens_and_context_limit_end_where_they_do_without() -> None:
    prompt = copy_prompts(1, seed=5)[0]
    ref = reference(copy_next, prompt, 60)
    eos = next(t for i, t in enumerate(ref) if i > 15 and ref.index(t) == i)
    stop, length = FinishReason.STOP, FinishReason.LENGTH
    until_eos = ref[: ref.index(eos) + 1]
    greedy = SamplingParams(temperature=0.0, max_tokens=60)
    cases = [  # (eos ids, max_model_len, params, expected tokens, finish reason)
        ((eos,), 128, greedy, until_eos, stop),
        ((), 128, SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=(eos,)),
         until_eos, stop),
        ((), len(prompt) + 23, greedy, ref[:23], length),
        ((eos,), 128, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), ref,
         length),
    ]  # fmt: skip
    for eos_ids, max_model_len, params, expected, reason in cases:
        for speculative in (False, True):
            engine = make_engine(speculative, eos=eos_ids, max_model_len=max_model_len)
            outputs = run_all(engine, [prompt], [params])[0]
            assert tokens_of(outputs) == expected
            assert outputs[-1].finish_reason is reason
            assert engine.speculation.num_accepted_tokens > 0 or not speculative


def test_stop_strings_cut_the_same_text() -> None:
    prompt = copy_prompts(1, seed=9)[0]
    letters = "".join(chr(97 + t % 26) for t in reference(copy_next, prompt, 60))
    stop = letters[30:33]
    runs = []
    for speculative in (False, True):
        engine = make_engine(speculative)
        engine.decoder_factory = lambda _prompt, _skip: LetterDecoder()
        params = SamplingParams(temperature=0.0, max_tokens=60, stop=(stop,))
        runs.append(run_all(engine, [prompt], [params])[0])
    texts = ["".join(o.text for o in r) for r in runs]
    assert texts[0] == texts[1] == letters[: letters.index(stop)]
    assert tokens_of(runs[0]) == tokens_of(runs[1])
    assert runs[1][-1].finish_reason is FinishReason.STOP


def test_seeded_sampling_with_penalties_equals_without_speculation() -> None:
    """Each draft's row samples with the seed and the penalties of the token it would be, so a
    seeded request gives the same tokens with speculation. Few distinct tokens: the drafts are
    the tokens the penalties push down."""
    prompts = copy_prompts(6, seed=11, vocab=6)
    params = [
        SamplingParams(
            temperature=0.3, seed=40 + i, max_tokens=40, ignore_eos=True,
            presence_penalty=0.5 * (i % 2), frequency_penalty=0.4 * (i % 3),
        )
        for i in range(len(prompts))
    ]  # fmt: skip
    plain = run_all(make_engine(False), prompts, params)
    engine = make_engine(True)
    spec = run_all(engine, prompts, params)
    assert [tokens_of(o) for o in spec] == [tokens_of(o) for o in plain]
    greedy = [reference(copy_next, p, 40) for p in prompts]
    assert [tokens_of(o) for o in spec] != greedy  # really sampled
    s = engine.speculation
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens


def test_logprobs_of_accepted_tokens_equal_those_without_speculation() -> None:
    prompts = copy_prompts(3, seed=13)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3)] * 3
    plain = run_all(make_engine(False), prompts, params)
    engine = make_engine(True)
    spec = run_all(engine, prompts, params)
    assert engine.speculation.num_accepted_tokens > 0
    for a, b in zip(plain, spec, strict=True):
        lps_a = [lp for o in a for lp in o.logprobs or []]
        lps_b = [lp for o in b for lp in o.logprobs or []]
        assert [lp.token_id for lp in lps_b] == tokens_of(b) == tokens_of(a)
        for x, y in zip(lps_a, lps_b, strict=True):
            assert x.top_token_ids == y.top_token_ids
            assert x.logprob == pytest.approx(y.logprob, abs=1e-6)
            assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=1e-6)


def test_speculation_settings_are_validated_and_read_from_parameters() -> None:
    with pytest.raises(ConfigError, match=r"'speculative'.*'eagle' is not one of none, ngram"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ConfigError, match=r"'prompt_lookup_max': must be >= prompt_lookup_min"):
        EngineConfig(speculative="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ConfigError, match=r"'num_speculative_tokens': must be >= 1"):
        EngineConfig(num_speculative_tokens=0)
    off = engine_config_from(ModelConfig(name="m", backend="llm"))
    assert off.speculative == "none"
    assert make_engine(False).scheduler.proposer is None
    parameters = {
        "speculative": "ngram",
        "num_speculative_tokens": "6",
        "prompt_lookup_min": "1",
        "prompt_lookup_max": "3",
    }
    on = engine_config_from(ModelConfig(name="m", backend="llm", parameters=parameters))
    assert (on.speculative, on.num_speculative_tokens) == ("ngram", 6)
    assert (on.prompt_lookup_min, on.prompt_lookup_max) == (1, 3)
    with pytest.raises(ConfigError, match=r"parameters.prompt_lookup_min.*not a int"):
        engine_config_from(
            ModelConfig(name="m", backend="llm", parameters={"prompt_lookup_min": "two"})
        )


# -- SmolLM2 -----------------------------------------------------------------------------------

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every "
    "night its keeper climbed the narrow stairs, trimmed the wick and polished the great lens, "
    "so that ships passing in the dark would know where the rocks were."
)
COPY = "Repeat this text exactly: " + PARAGRAPH
FREE = "Explain how photosynthesis works in plants."


def real_engine(
    checkpoint: Checkpoint, model: CausalLM, tokenizer: ChatTokenizer, speculative: bool
) -> LLMEngine:
    config = EngineConfig(
        block_size=16,
        kv_cache_blocks=24,
        max_model_len=384,
        speculative="ngram" if speculative else "none",
    )
    return smollm2_engine(checkpoint, model, tokenizer, config)

    kv = allocate_llama_kv_cache(checkpoint.config, 24, 16, "float32")
    return LLMEngine(
        model,
        kv,
        config,
        eos_token_ids=tokenizer.eos_token_ids,
        decoder_factory=lambda _prompt, skip: IncrementalDetokenizer(tokenizer, skip),
    )


def both(
    checkpoint: Checkpoint,
    model: LlamaForCausalLM,
    tokenizer: ChatTokenizer,
    prompt: list[int],
    params: SamplingParams,
) -> tuple[list[RequestOutput], list[RequestOutput], LLMEngine]:
    """The request's outputs without and with speculation, and the speculating engine."""
    plain = run_all(real_engine(checkpoint, model, tokenizer, False), [prompt], [params])[0]
    engine = real_engine(checkpoint, model, tokenizer, True)
    return plain, run_all(engine, [prompt], [params])[0], engine


@pytest.mark.usefixtures("one_thread")
def test_smollm2_greedy_copy_is_identical_and_mostly_accepted(
    checkpoint: Checkpoint, model: LlamaForCausalLM, tokenizer: ChatTokenizer
) -> None:
    prompt = tokenizer.encode_chat([{"role": "user", "content": COPY}])
    plain, spec, engine = both(
        checkpoint, model, tokenizer, prompt, SamplingParams(temperature=0.0, max_tokens=120)
    )
    assert tokens_of(spec) == tokens_of(plain)
    assert "".join(o.text for o in spec) == "".join(o.text for o in plain)
    assert PARAGRAPH[:60] in "".join(o.text for o in spec)  # the model does copy it
    assert spec[-1].finish_reason is plain[-1].finish_reason is FinishReason.STOP  # EOS
    s = engine.speculation
    assert s.acceptance_rate > 0.5, (s.num_accepted_tokens, s.num_draft_tokens)
    assert len(spec) < len(plain) / 2  # several tokens per step


@pytest.mark.usefixtures("one_thread")
def test_smollm2_greedy_free_text_is_identical(
    checkpoint: Checkpoint, model: LlamaForCausalLM, tokenizer: ChatTokenizer
) -> None:
    prompt = tokenizer.encode_chat([{"role": "user", "content": FREE}])
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    plain, spec, engine = both(checkpoint, model, tokenizer, prompt, params)
    assert tokens_of(spec) == tokens_of(plain) and len(tokens_of(spec)) == 60
    assert engine.speculation.acceptance_rate < 0.5  # few lookups hit in free text


@pytest.mark.usefixtures("one_thread")
def test_smollm2_max_tokens_stop_strings_and_logprobs(
    checkpoint: Checkpoint, model: LlamaForCausalLM, tokenizer: ChatTokenizer
) -> None:
    prompt = tokenizer.encode_chat([{"role": "user", "content": COPY}])
    # max_tokens in the middle of an accepted run: exactly 37 tokens, never more
    params = SamplingParams(temperature=0.0, max_tokens=37, logprobs=2)
    plain, spec, engine = both(checkpoint, model, tokenizer, prompt, params)
    assert tokens_of(spec) == tokens_of(plain) and len(tokens_of(spec)) == 37
    assert spec[-1].finish_reason is FinishReason.LENGTH
    assert engine.speculation.num_accepted_tokens > 10
    lps_plain = [lp for o in plain for lp in o.logprobs or []]
    lps_spec = [lp for o in spec for lp in o.logprobs or []]
    assert [lp.token_id for lp in lps_spec] == tokens_of(spec)
    for x, y in zip(lps_plain, lps_spec, strict=True):
        assert x.top_token_ids == y.top_token_ids
        assert x.logprob == pytest.approx(y.logprob, abs=1e-3)
        assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=1e-3)
    # a stop string in the middle of the copied paragraph
    params = SamplingParams(temperature=0.0, max_tokens=120, stop=("narrow",))
    plain, spec, engine = both(checkpoint, model, tokenizer, prompt, params)
    text = "".join(o.text for o in spec)
    assert text == "".join(o.text for o in plain) and text.endswith("climbed the ")
    assert tokens_of(spec) == tokens_of(plain)
    assert spec[-1].finish_reason is FinishReason.STOP
