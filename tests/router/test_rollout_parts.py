"""The bookkeeping behind canaries, shadows, sticky sessions, rate limits and prefix routing:
pure functions and small classes, tested without a process."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from lockgate.core.metrics import Registry
from lockgate.router import rendezvous
from lockgate.router.canary import Canary, CanaryRule
from lockgate.router.compare import Answer, agree
from lockgate.router.groups import ReplicaGroups, label_of
from lockgate.router.llm_request import LLMRequest
from lockgate.router.llm_routing import LLMRouting, LLMRoutingSettings
from lockgate.router.model_counts import ModelCounts
from lockgate.router.model_path import ModelPath
from lockgate.router.rate_limits import Limit, RateLimiter, load_limits
from lockgate.router.replica import Replica
from lockgate.router.shadow import ShadowRule, ShadowSettings
from lockgate.router.token_bucket import TokenBucket
from lockgate.router.upstream import Response, Upstream
from lockgate.router.usage import UsageMeter


def replica(n: int, load: int = 0) -> Replica:
    r = Replica(f"http://127.0.0.1:{9000 + n}", Upstream("127.0.0.1", 9000 + n))
    r.ready, r.in_flight = True, load
    return r


# -- canary --------------------------------------------------------------------------------


def test_canary_rules_parse_and_refuse_bad_ones() -> None:
    assert CanaryRule.parse("digits:2=10") == CanaryRule("digits", 10.0, version="2")
    assert CanaryRule.parse("m:#canary=2.5%") == CanaryRule("m", 2.5, group="canary")
    for bad in ("digits=10", "digits:x=10", "digits:0=10", "d:2=101", "d:2=-1", "d:2=nan", "d:#=5"):
        with pytest.raises(ValueError):
            CanaryRule.parse(bad)
    with pytest.raises(ValueError, match="over 100"):
        Canary([CanaryRule.parse("m:1=60"), CanaryRule.parse("m:2=50")])


def test_canary_shares_follow_the_weights() -> None:
    rules = [CanaryRule.parse("m:1=25"), CanaryRule.parse("m:#c=10")]
    canary = Canary(rules, random.Random(7))
    n = 20_000
    chosen = Counter(canary.choose("m", True) for _ in range(n))
    assert abs(chosen[rules[0]] / n - 0.25) < 0.02 and abs(chosen[rules[1]] / n - 0.10) < 0.02
    assert canary.choose("other", True) is None
    # a request that names its version (path or header) keeps only group rules
    fixed = Counter(canary.choose("m", False) for _ in range(n))
    assert rules[0] not in fixed and abs(fixed[rules[1]] / n - 0.10) < 0.02


def test_model_paths() -> None:
    assert ModelPath.parse("POST", "/v2/models/m/infer") == ModelPath("m", None, "infer")
    path = ModelPath.parse("POST", "/v2/models/m/versions/3/generate")
    assert (
        path == ModelPath("m", "3", "generate")
        and path.at("2") == "/v2/models/m/versions/2/generate"
    )
    for method, bad in (
        ("GET", "/v2/models/m/infer"),
        ("POST", "/v2/models/m"),
        ("POST", "/v2/models//infer"),
        ("POST", "/v2/models/m/ready"),
    ):
        assert ModelPath.parse(method, bad) is None


def test_groups_come_from_url_labels() -> None:
    groups = ReplicaGroups.of_urls(["http://127.0.0.1:9001", "127.0.0.1:9002#canary"])
    a, b = replica(1), replica(2)
    assert groups.group(a) == "" and groups.group(b) == "canary"
    assert groups.members([a, b], "") == [a] and groups.members([a, b], "canary") == [b]
    with pytest.raises(ValueError):
        label_of("http://h:1#bad label")


def test_model_counts_are_bounded() -> None:
    registry = Registry()
    counts = ModelCounts(registry, max_models=2)
    counts.count("a", None, "", 200)
    counts.count("a", "2", "canary", 200)
    counts.count("missing", None, "", 404)  # no series for what does not exist
    counts.count("b", None, "", 200)
    counts.count("c", None, "", 200)  # past the bound
    values = counts.requests.values()
    assert values == {
        ("a", "latest", "main", "200"): 1.0,
        ("a", "2", "canary", "200"): 1.0,
        ("b", "latest", "main", "200"): 1.0,
        ("_other", "latest", "main", "200"): 1.0,
    }


# -- rendezvous, sticky and prefix routing -------------------------------------------------


def test_rendezvous_moves_only_the_keys_of_a_replica_that_left() -> None:
    replicas = [replica(i) for i in range(4)]
    keys = [f"session-{i}".encode() for i in range(400)]
    before = {k: rendezvous.first(k, replicas) for k in keys}
    assert len({r.url for r in before.values() if r is not None}) == 4
    gone = replicas[1]
    after = {k: rendezvous.first(k, [r for r in replicas if r is not gone]) for k in keys}
    moved = [k for k in keys if after[k] is not before[k]]
    assert moved and all(before[k] is gone for k in moved)
    assert rendezvous.ranked(keys[0], replicas)[0] is before[keys[0]]


def test_prefix_routing_keeps_a_prefix_on_its_replica_unless_it_is_too_busy() -> None:
    replicas = [replica(i) for i in range(3)]
    routing = LLMRouting(LLMRoutingSettings("prefix", 64, 2), Registry())
    prefix = b"model\nYou are a helpful assistant"
    home = routing.pick(prefix, replicas)
    assert all(routing.pick(prefix, replicas) is home for _ in range(20))
    assert home is not None
    home.in_flight = 2  # within the margin of the least loaded (0)
    assert routing.pick(prefix, replicas) is home
    home.in_flight = 3  # past it: the prefix's next choice, which is within the margin
    spilled = routing.pick(prefix, replicas)
    assert spilled is rendezvous.ranked(prefix, replicas)[1]
    assert routing.choices.values() == {("prefix",): 22.0, ("spilled",): 1.0}


def test_least_load_routing_takes_the_least_loaded() -> None:
    replicas = [replica(0, load=3), replica(1, load=1), replica(2, load=2)]
    routing = LLMRouting(LLMRoutingSettings("least-load"), Registry(), random.Random(1))
    assert all(routing.pick(b"x", replicas) is replicas[1] for _ in range(10))
    with pytest.raises(ValueError):
        LLMRoutingSettings("round-robin")  # type: ignore[arg-type]


def test_llm_requests_read_model_budget_and_prefix() -> None:
    body = {"model": "m", "prompt": "x" * 1000, "max_tokens": 7, "stream": True}
    req = LLMRequest.parse(json.dumps(body).encode(), prefix_chars=10)
    assert (req.model, req.max_tokens, req.stream, req.charge) == ("m", 7, True, 7)
    assert req.prefix == b"m\n" + b"x" * 10
    chat = {
        "model": "m",
        "max_completion_tokens": 5,
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "Hi " * 100},
        ],
    }
    req = LLMRequest.parse(json.dumps(chat).encode(), prefix_chars=20)
    assert req.max_tokens == 5 and not req.stream
    assert req.prefix == b"m\nsystem\nBe brief.\nuse"  # 20 characters after the model
    other_user = {**chat, "messages": [chat["messages"][0], {"role": "user", "content": "Bye"}]}
    assert LLMRequest.parse(json.dumps(other_user).encode(), 20).prefix == req.prefix
    broken = LLMRequest.parse(b"{not json", 10)
    assert broken.model == "" and broken.charge == 16  # still charged: the replica decides
    assert LLMRequest.parse(b'{"prompt": "hi", "max_tokens": "9"}', 10).charge == 16


# -- rate limits and token quotas ----------------------------------------------------------


def test_token_bucket_waits_takes_and_settles() -> None:
    bucket = TokenBucket.full(rate=2.0, capacity=4.0, now=0.0)
    assert bucket.wait(4, 0.0) == 0.0
    bucket.take(4, 0.0)
    assert bucket.wait(1, 0.0) == pytest.approx(0.5)
    assert bucket.wait(1, 0.5) == 0.0
    assert bucket.wait(100, 0.5) == pytest.approx(1.5)  # at most the capacity is waited for
    bucket.give(-10)  # settled: more used than charged, a debt
    assert bucket.tokens == pytest.approx(-9.0)
    bucket.give(100)
    assert bucket.tokens == 4.0  # never above the capacity


def test_rate_limiter_buckets_per_key_with_retry_after(tmp_path: Path) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text(
        "default: {requests_per_second: 1, burst: 2}\n"
        "anonymous: {requests_per_second: 0.5, burst: 1}\n"
        "keys:\n  gold: {requests_per_second: 100, burst: 100, tokens_per_minute: 600}\n"
    )
    settings = load_limits(path, Limit(), max_keys=3, key_header="authorization")
    limiter = RateLimiter(settings)
    alice = [(b"authorization", b"Bearer alice")]
    client = limiter.client(alice, 0.0)
    assert client is not None and client.tokens is None
    assert client.admit_request(0.0) is None and client.admit_request(0.0) is None
    refusal = client.admit_request(0.1)
    assert refusal is not None and refusal.limit == "requests" and refusal.retry_after == 1
    assert limiter.client(alice, 1.0) is client and client.admit_request(1.0) is None
    anonymous = limiter.client([], 0.0)
    assert anonymous is not None and anonymous.requests is not None
    assert anonymous.requests.rate == 0.5
    assert anonymous.admit_request(0.0) is None
    late = anonymous.admit_request(0.0)
    assert late is not None and late.retry_after == 2
    gold = limiter.client([(b"authorization", b"Bearer gold")], 0.0)
    assert gold is not None and gold.tokens is not None
    assert gold.admit_tokens(500, 0.0) is None
    refused = gold.admit_tokens(200, 0.0)
    assert refused is not None and refused.limit == "tokens" and refused.retry_after == 10
    gold.settle(500, 50)  # used 50 of the 500 charged: 450 back
    assert gold.admit_tokens(200, 0.0) is None
    gold.settle(200, None)  # unknown: the charge stands
    assert gold.tokens.tokens == pytest.approx(350.0)
    # bounded: past max_keys the least recently seen is forgotten
    for name in (b"b", b"c", b"d"):
        limiter.client([(b"authorization", b"Bearer " + name)], 2.0)
    assert len(limiter.clients) == 3 and limiter.client(alice, 2.0) is not client
    assert b"alice" not in b"".join(limiter.clients)  # keys are kept as digests


def test_rate_limit_key_header_and_file_errors(tmp_path: Path) -> None:
    settings = load_limits(None, Limit(requests_per_second=1), 10, "X-Api-Key")
    limiter = RateLimiter(settings)
    assert limiter.key([(b"x-api-key", b"k1")]) == b"k1"
    assert limiter.key([(b"authorization", b"Bearer k2")]) == b""  # not the key header
    unlimited = RateLimiter(load_limits(None, Limit(), 10, "authorization"))
    assert not unlimited.settings.enabled and unlimited.client([], 0.0) is None
    path = tmp_path / "bad.yaml"
    path.write_text("keys:\n  k: {requests_per_second: fast}\n")
    with pytest.raises(ValueError, match=r"bad.yaml.*requests_per_second"):
        load_limits(path, Limit(), 10, "authorization")
    path.write_text("default: {rps: 1}\n")
    with pytest.raises(ValueError, match="rps"):
        load_limits(path, Limit(), 10, "authorization")
    with pytest.raises(ValueError):
        Limit(requests_per_second=-1)


def _sse(*events: dict) -> bytes:
    return (
        b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    )


def test_usage_meter_counts_streamed_tokens_or_reads_usage() -> None:
    chunk = {"choices": [{"index": 0, "text": "a"}]}
    stream = _sse(*[chunk] * 5)
    meter = UsageMeter(stream=True)
    meter.head(Response(200, []))
    for i in range(0, len(stream), 7):  # events split across chunks
        meter.feed(stream[i : i + 7])
    meter.end()
    assert meter.used() == 5
    with_usage = _sse(chunk, chunk, {"choices": [], "usage": {"completion_tokens": 9}})
    meter = UsageMeter(stream=True)
    meter.head(Response(200, []))
    meter.feed(with_usage)
    assert meter.used() == 9
    whole = UsageMeter(stream=False)
    whole.head(Response(200, []))
    whole.feed(b'{"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 3, ')
    whole.feed(b'"completion_tokens": 12, "total_tokens": 15}}')
    whole.end()
    assert whole.used() == 15  # prompt and completion
    refused = UsageMeter(stream=False)
    refused.head(Response(404, []))
    assert refused.used() == 0
    unreadable = UsageMeter(stream=False, max_bytes=4)
    unreadable.head(Response(200, []))
    unreadable.feed(b'{"usage": {"completion_tokens": 1}}')
    unreadable.end()
    assert unreadable.used() is None  # the charge stands
    assert UsageMeter(stream=True).used() == 0  # no answer from a replica at all


# -- shadows -------------------------------------------------------------------------------


def _v2(*outputs: dict) -> bytes:
    return json.dumps({"model_name": "m", "id": "1", "outputs": list(outputs)}).encode()


def test_answers_agree_within_the_tolerance() -> None:
    def out(data: list, datatype: str = "FP32", shape: list | None = None) -> dict:
        return {"name": "y", "datatype": datatype, "shape": shape or [1, len(data)], "data": data}

    a = Answer(200, _v2(out([1.0, 2.0, None])))
    assert agree(a, Answer(200, _v2(out([1.0000001, 2.0, None]))), 1e-5)
    assert not agree(a, Answer(200, _v2(out([1.1, 2.0, None]))), 1e-5)
    assert not agree(a, Answer(200, _v2(out([1.0, 2.0, None], shape=[3, 1]))), 1e-5)
    assert not agree(a, Answer(200, _v2(out([1.0, 2.0, None], "FP64"))), 1e-5)
    assert not agree(a, Answer(200, _v2(out([1.0, 2.0, None]), out([1.0]) | {"name": "z"})), 1)
    assert not agree(a, Answer(503, b"{}"), 1e-5)
    assert agree(Answer(400, b'{"error": "x"}'), Answer(400, b'{"error": "y"}'), 0)
    words = Answer(200, _v2(out(["a", "b"], "BYTES")))
    assert agree(words, words, 0) and not agree(
        words, Answer(200, _v2(out(["a", "c"], "BYTES"))), 1
    )
    # binary tensors: the JSON head's outputs, then the bytes after it, byte for byte
    head = _v2(
        {"name": "y", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}}
    )
    binary = Answer(200, head + b"\x00\x00\x80?", len(head))
    assert agree(binary, Answer(200, head + b"\x00\x00\x80?", len(head)), 1e-5)
    assert not agree(binary, Answer(200, head + b"\x00\x00\x00@", len(head)), 1e-5)
    assert agree(Answer(200, b"plain"), Answer(200, b"plain"), 0)


def test_shadow_rules_parse() -> None:
    assert ShadowRule.parse("m=http://10.0.0.9:8000:5") == ShadowRule(
        "m", "http://10.0.0.9:8000", 5
    )
    assert ShadowRule.parse("m=#candidate:100").group == "candidate"
    for bad in ("m", "m=#x", "m=ftp://h:1:5", "m=#x:150"):
        with pytest.raises(ValueError):
            ShadowRule.parse(bad)
    with pytest.raises(ValueError, match="one rule per model"):
        ShadowSettings((ShadowRule.parse("m=#a:1"), ShadowRule.parse("m=#b:1")))


class _CodedHead:
    """The parts of an upstream Response the shadow's Mirror reads."""

    status = 200

    def __init__(self, coding: bytes | None) -> None:
        self.coding = coding

    def header(self, name: bytes) -> bytes | None:
        return self.coding if name == b"content-encoding" else None


@pytest.mark.parametrize("coding", [b"gzip", b"deflate", None, b"br"])
def test_a_compressed_client_answer_is_inflated_to_be_compared(coding: bytes | None) -> None:
    import asyncio
    import gzip
    import zlib

    from lockgate.router.shadow import Mirror

    body = _v2({"name": "y", "datatype": "FP32", "shape": [1, 3], "data": [1.0, 2.0, 3.0]})
    sent = {b"gzip": gzip.compress(body), b"deflate": zlib.compress(body)}.get(coding, body)

    async def mirrored() -> Answer | None:
        mirror = Mirror(limit=1 << 20)
        mirror.head(_CodedHead(coding))  # type: ignore[arg-type]
        mirror.feed(sent[:10])
        mirror.feed(sent[10:])
        mirror.end()
        mirror.close()
        return await mirror.answered

    answer = asyncio.run(mirrored())
    assert answer is not None
    # another coding is left uncompared (no body), as a body too large to keep is
    assert answer.body == (None if coding == b"br" else body)
