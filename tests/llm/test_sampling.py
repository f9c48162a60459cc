from __future__ import annotations

import pytest
import torch

from lockgate.errors import BadRequest
from lockgate.llm import sampling
from lockgate.llm.sampling import (
    LOGPROB_FLOOR,
    Sampler,
    SamplingBatch,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_k_top_p,
)
from lockgate.llm.sequence import SamplingParams

V = 50


def batch_for(
    params: list[SamplingParams], outputs: list[list[int]] | None = None
) -> SamplingBatch:
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingBatch.build(params, outputs, [len(o) for o in outputs], V)


def random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_are_exactly_argmax() -> None:
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=1.5)] * 3
    out = Sampler(seed=1)(logits, batch_for(params))
    assert out.token_ids[:3] == logits[:3].argmax(dim=-1).tolist()
    all_greedy = Sampler(seed=1)(logits, batch_for([SamplingParams(temperature=0.0)] * 6))
    assert all_greedy.token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_ignores_filters() -> None:
    logits = random_logits(2)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.5)] * 2
    assert Sampler()(logits, batch_for(params)).token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_exactly_k_per_row() -> None:
    logits = random_logits(3)
    top_k = torch.tensor([1, 5, V])
    out = apply_top_k(logits, top_k)
    kept = torch.isfinite(out).sum(dim=-1).tolist()
    assert kept == [1, 5, V]
    assert torch.equal(
        out[1].topk(5).indices.sort().values, logits[1].topk(5).indices.sort().values
    )


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    out = apply_top_k_top_p(logits, None, torch.tensor([0.7, 1.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(out[1]).all()
    out = apply_top_k_top_p(logits, torch.tensor([1, 4]), torch.tensor([0.9, 0.5]))
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]
    assert int(torch.isfinite(out[1]).sum()) == 2


def test_min_p_drops_tokens_below_the_scaled_top_probability() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = apply_min_p(logits, torch.tensor([0.4]))  # threshold 0.2
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]


def test_sampled_tokens_respect_filters() -> None:
    logits = random_logits(64, seed=3)
    params = [SamplingParams(temperature=2.0, top_k=3)] * 64
    out = Sampler(seed=0)(logits, batch_for(params))
    allowed = logits.topk(3, dim=-1).indices.tolist()
    assert all(t in allowed[i] for i, t in enumerate(out.token_ids))


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).expand(4000, 3).contiguous()
    params = [SamplingParams(temperature=1.0)] * 4000
    batch = SamplingBatch.build(params, [[]] * 4000, [0] * 4000, 3)
    counts = torch.bincount(torch.tensor(Sampler(seed=7)(logits, batch).token_ids), minlength=3)
    assert torch.allclose(counts.float() / 4000, probs, atol=0.03)


def test_seeded_rows_are_reproducible_and_independent_of_the_batch() -> None:
    logits = random_logits(4, seed=5)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler()(logits[2:3], batch_for([seeded]))
    mixed = Sampler()(logits, batch_for([SamplingParams(temperature=1.0)] * 2 + [seeded] * 2))
    assert mixed.token_ids[2] == alone.token_ids[0]
    draws = {Sampler()(logits[2:3], batch_for([seeded])).token_ids[0] for _ in range(5)}
    assert draws == {alone.token_ids[0]}
    varied = {
        Sampler()(logits[2:3], batch_for([SamplingParams(temperature=1.0, seed=s)])).token_ids[0]
        for s in range(40)
    }
    assert len(varied) > 1


def test_penalties_subtract_counts_and_presence() -> None:
    logits = torch.zeros(2, V)
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=1.0),
        SamplingParams(temperature=0.0),
    ]
    batch = batch_for(params, [[3, 3, 7], [3]])
    out = Sampler()(logits, SamplingBatch.build(params, [[3, 3, 7], [3]], [3, 1], V))
    penalized = apply_penalties(logits, batch)
    assert penalized[0, 3] == pytest.approx(-(0.5 * 2 + 1.0))
    assert penalized[0, 7] == pytest.approx(-(0.5 + 1.0))
    assert penalized[0, 0] == 0.0 and torch.all(penalized[1] == 0.0)
    assert out.token_ids[0] not in (3, 7)


def test_repetition_penalty_scales_the_logits_of_seen_tokens_toward_less_likely() -> None:
    logits = torch.zeros(2, V)
    logits[:, 1], logits[:, 2] = 2.0, -2.0
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams()]
    batch = SamplingBatch.build(params, [[], []], [0, 0], V, seen_token_ids=[[1, 2, 2], []])
    penalized = apply_penalties(logits, batch)
    assert penalized[0, 1] == 1.0 and penalized[0, 2] == -4.0  # divided; multiplied
    assert torch.equal(penalized[1], logits[1])  # a row without it is left alone
    assert penalized[0, 0] == 0.0


def test_logprobs_are_the_models_whatever_the_sampling() -> None:
    """Logprobs are the log_softmax of the raw logits: temperature, top-k, penalties and
    biases change what is drawn, not what the model said of it (a filtered token is not
    -inf, and the chosen token of a low temperature is not 0.0)."""
    logits = random_logits(3, seed=9)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.2, top_k=4, logprobs=3, presence_penalty=1.0),
        SamplingParams(temperature=1.0),
    ]
    out = Sampler(seed=0)(logits, SamplingBatch.build(params, [[1], [2], []], [1, 1, 1], V))
    greedy, filtered, none = out.logprobs
    assert none is None and greedy is not None and filtered is not None
    expected = logits[0].log_softmax(-1)
    assert greedy.token_id == out.token_ids[0]
    assert greedy.logprob == pytest.approx(float(expected.max()), abs=1e-5)
    assert greedy.top_token_ids == expected.topk(5).indices.tolist()
    model = logits[1].log_softmax(-1)
    assert filtered.top_token_ids == model.topk(3).indices.tolist()
    assert filtered.top_logprobs == pytest.approx(model.topk(3).values.tolist(), abs=1e-5)
    assert filtered.logprob == pytest.approx(float(model[out.token_ids[1]]), abs=1e-5)
    assert filtered.logprob < -1e-3  # not the 0.0 of the filtered distribution


def test_a_token_of_no_chance_reports_a_finite_floor() -> None:
    logits = random_logits(1, seed=3)
    logits[0, 5:] = float("-inf")
    out = Sampler(seed=0)(logits, batch_for([SamplingParams(temperature=0.0, logprobs=8)]))
    (row,) = out.logprobs
    assert row is not None and min(row.top_logprobs) == LOGPROB_FLOOR == -9999.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_k": -2},
        {"min_p": 1.5},
        {"max_tokens": 0},
        {"presence_penalty": 3.0},
        {"logprobs": 21},
        {"stop": ("",)},
        {"seed": -1},
        {"allowed_token_ids": ()},
        {"allowed_token_ids": (3, -1)},
        {"bad_words_token_ids": ((),)},
    ],
)
def test_invalid_params_raise_a_clear_400(kwargs: dict[str, object]) -> None:
    with pytest.raises(BadRequest, match="invalid sampling parameters") as err:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert err.value.status == 400
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("window", [4, 128])
def test_windowed_top_p_equals_the_full_sort(window: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling, "TOP_P_WINDOW", window)
    logits = random_logits(16, seed=11) * 0.3  # flat rows: wide nuclei
    top_p = torch.linspace(0.05, 1.0, 16)
    top_k = torch.tensor([V, 3, V, 10] * 4)
    for k in (None, top_k):
        fast = apply_top_k_top_p(logits, k, top_p)
        full_k = k if k is not None else torch.full((16,), V)
        slow = sampling._top_k_top_p_sorted(logits, full_k, top_p)
        assert torch.equal(torch.isfinite(fast), torch.isfinite(slow))
        assert torch.equal(fast[torch.isfinite(fast)], logits[torch.isfinite(fast)])


def test_logit_bias_moves_the_chosen_logits_of_its_rows_only() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    top = logits.argmax(dim=-1).tolist()
    banned = SamplingParams(temperature=0.0, logit_bias=((top[0], -100.0),))
    forced = SamplingParams(temperature=0.0, logit_bias=((7, 100.0),))
    plain = SamplingParams(temperature=0.0)
    out = Sampler(seed=1)(logits, batch_for([banned, forced, plain]))
    expected_first = logits[0].clone()
    expected_first[top[0]] -= 100.0
    assert out.token_ids == [int(expected_first.argmax()), 7, top[2]]
    with pytest.raises(BadRequest, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),))


def test_allowed_token_ids_hold_their_rows_only_to_those_tokens() -> None:
    logits = random_logits(3, seed=4)
    top = logits.argmax(dim=-1).tolist()
    allowed = sorted({(top[0] + 1) % V, (top[0] + 7) % V})
    limited = SamplingParams(temperature=0.0, allowed_token_ids=tuple(allowed))
    hot = SamplingParams(temperature=2.0, allowed_token_ids=(allowed[0],))
    plain = SamplingParams(temperature=0.0)
    out = Sampler(seed=1)(logits, batch_for([limited, hot, plain]))
    best = max(allowed, key=lambda t: float(logits[0, t]))
    assert out.token_ids == [best, allowed[0], top[2]]
    many = random_logits(64, seed=5)
    sampled = Sampler(seed=2)(many, batch_for([SamplingParams(allowed_token_ids=(1, 4))] * 64))
    assert set(sampled.token_ids) <= {1, 4}


def test_bad_words_block_a_words_last_token_after_the_rest_of_it() -> None:
    params = SamplingParams(bad_words_token_ids=((9,), (3, 4, 5)))
    assert params.bad_words_blocked([]) == [9]  # a one-token word: always
    assert params.bad_words_blocked([1, 3]) == [9]
    assert params.bad_words_blocked([1, 3, 4]) == [9, 5]
    assert params.bad_words_blocked([3, 4, 1]) == [9]
    logits = torch.zeros(2, V)
    logits[:, 5] = 10.0
    logits[:, 9] = 5.0
    greedy = SamplingParams(temperature=0.0, bad_words_token_ids=((9,), (3, 4, 5)))
    out = Sampler()(logits, batch_for([greedy, greedy], [[3, 4], [4, 3]]))
    assert out.token_ids == [0, 5]  # after 3, 4: neither 5 nor 9; after 4, 3: 5
