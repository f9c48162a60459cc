"""/metrics of a real server after KServe v2 and language-model traffic: valid for promtool,
in the text format 0.0.4 or, when asked, OpenMetrics."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from lockgate.cli import _metrics_compat, main
from lockgate.config import ModelConfig
from lockgate.core.compat_metrics import REASONS
from lockgate.core.manager import ModelManager, ModelState, ServedModel, ServedVersion
from lockgate.core.metrics import Registry
from lockgate.frontend.app import App, ServerSettings
from lockgate.frontend.openai_routes import OpenAIRoutes
from lockgate.llm.async_engine import AsyncLLMEngine
from tests.conftest import RunningServer, digits_rows
from tests.core.test_compat_metrics import NOWHERE
from tests.core.test_metrics import promtool_check
from tests.llm.test_engine import make_engine
from tests.llm.test_service import served

MODEL = "SmolLM2-135M-Instruct"
TEXTS = {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["a cat"]}]}


def traffic(server: RunningServer) -> None:
    assert httpx.post(server.url + "/v2/models/minilm/infer", json=TEXTS).is_success
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)


def test_promtool_accepts_the_scrape(llm_server: RunningServer) -> None:
    traffic(llm_server)
    scrape = httpx.get(llm_server.url + "/metrics")
    assert scrape.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    for series in (
        'lockgate_request_duration_seconds_count{model="minilm",version="1"}',
        f'lockgate_llm_time_to_first_token_seconds_count{{model_name="{MODEL}"}}',
        "process_resident_memory_bytes",
        "python_gc_objects_collected_total",
    ):
        assert series in scrape.text, series
    promtool_check(scrape.text)


def test_openmetrics_when_the_scraper_asks(llm_server: RunningServer) -> None:
    traffic(llm_server)
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    scrape = httpx.get(llm_server.url + "/metrics", headers={"accept": accept})
    assert scrape.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert scrape.text.endswith("# EOF\n")
    assert "# TYPE lockgate_requests counter\n" in scrape.text  # OpenMetrics names the family
    assert 'lockgate_requests_total{model="minilm",outcome="success",version="1"}' in scrape.text


# -- Triton's and vLLM's names (--metrics-compat, on by default) ---------------------------

DIGITS = 'model="digits_onnx",version="1"'
TRITON_COUNTERS = (
    "nv_inference_request_success",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
)


def scraped(server: RunningServer) -> dict[str, float]:
    """One scrape: each series (name and labels as written) to its value."""
    text = httpx.get(server.url + "/metrics").text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_triton_names_count_the_requests_rows_and_batches(server: RunningServer) -> None:
    before = scraped(server)
    x = digits_rows(8)
    for rows in (1, 3, 4):  # one after another: one batch each
        body = {"inputs": [{"name": "input", "shape": [rows, 64], "datatype": "FP32",
                            "data": x[:rows].ravel().tolist()}]}  # fmt: skip
        assert httpx.post(server.url + "/v2/models/digits_onnx/infer", json=body).is_success
    after = scraped(server)
    grew = {
        n: after[f"{n}{{{DIGITS}}}"] - before.get(f"{n}{{{DIGITS}}}", 0.0) for n in TRITON_COUNTERS
    }
    assert grew["nv_inference_request_success"] == 3
    assert grew["nv_inference_count"] == 8
    assert grew["nv_inference_exec_count"] == 3
    for name in ("nv_inference_request_duration_us", "nv_inference_compute_infer_duration_us"):
        assert grew[name] > 0, name
    for name in TRITON_COUNTERS:
        assert grew[name] >= 0, name
    # the same scrape's own series, in microseconds
    own = after[f"lockgate_request_duration_seconds_sum{{{DIGITS}}}"] * 1e6
    assert after[f"nv_inference_request_duration_us{{{DIGITS}}}"] == pytest.approx(own)
    assert after[f"nv_inference_pending_request_count{{{DIGITS}}}"] == 0
    assert 'nv_inference_request_failure{model="digits_onnx",reason="BACKEND",version="1"}' in after
    assert not any(s.startswith("nv_cache_") for s in after)  # no model caches its answers


def test_triton_names_count_a_failure_by_reason(server: RunningServer) -> None:
    failure = 'nv_inference_request_failure{model="echo",reason="%s",version="1"}'
    before = scraped(server)
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [-13, 1, 2, 3]}]}
    assert httpx.post(server.url + "/v2/models/echo/infer", json=body).status_code == 500
    after = scraped(server)
    grew = {r: after[failure % r] - before.get(failure % r, 0.0) for r in REASONS}
    assert grew == {"REJECTED": 0, "CANCELED": 0, "BACKEND": 1, "OTHER": 0}
    success = 'nv_inference_request_success{model="echo",version="1"}'
    assert after[success] == before.get(success, 0.0)
    promtool_check(httpx.get(server.url + "/metrics").text)


def test_vllm_names_count_the_tokens_the_api_reported(llm_server: RunningServer) -> None:
    labels = f'{{model_name="{MODEL}"}}'
    names = (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    )
    before = idle(llm_server, labels)  # no request of an earlier test still counted meanwhile
    client = llm_server.openai_client()
    prompt = completion = 0
    for word in ("otter", "granite"):
        done = client.completions.create(model=MODEL, prompt=f"Tell me of {word}", max_tokens=5)
        assert done.usage is not None
        prompt += done.usage.prompt_tokens
        completion += done.usage.completion_tokens
    after = scraped(llm_server)
    grew = {n: after[n + labels] - before.get(n + labels, 0.0) for n in names}
    assert grew == {names[0]: prompt, names[1]: completion, names[2]: 2, names[3]: 2}
    success = f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'
    assert after[success] - before.get(success, 0.0) == 2
    # vLLM's names and lockgate's, one scrape: the same values
    for vllm, own in (("vllm:num_preemptions_total", "lockgate_llm_num_preemptions_total"),
                      ("vllm:prefix_cache_hits_total", "lockgate_llm_prefix_cache_hits_total"),
                      ("vllm:e2e_request_latency_seconds_sum",
                       "lockgate_llm_e2e_request_latency_seconds_sum")):  # fmt: skip
        assert after[vllm + labels] == after[own + labels], vllm


def idle(server: RunningServer, labels: str, timeout: float = 30.0) -> dict[str, float]:
    """A scrape once the engine runs and holds no request (a stream an earlier test closed
    may still be finishing)."""
    deadline = time.monotonic() + timeout
    while True:
        now = scraped(server)
        busy = now["vllm:num_requests_running" + labels] + now["vllm:num_requests_waiting" + labels]
        if not busy:
            return now
        assert time.monotonic() < deadline, f"{busy} requests still in the engine"
        time.sleep(0.1)


def test_vllm_gauges_during_a_stream(llm_server: RunningServer) -> None:
    labels = f'{{model_name="{MODEL}"}}'
    client = llm_server.openai_client()
    stream = client.completions.create(
        model=MODEL, prompt="Count to a hundred:", max_tokens=200, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))  # the first token is out: the request runs
    during = scraped(llm_server)
    stream.close()
    assert during["vllm:num_requests_running" + labels] >= 1
    assert during["vllm:num_requests_waiting" + labels] >= 0
    assert 0 < during["vllm:kv_cache_usage_perc" + labels] <= 1
    assert not any(series.startswith("vllm:gpu_cache_usage_perc") for series in during)
    assert (
        during["vllm:num_requests_running" + labels]
        == during["lockgate_llm_num_requests_running" + labels]
    )


def test_promtool_accepts_vllm_names(llm_server: RunningServer) -> None:
    traffic(llm_server)
    text = httpx.get(llm_server.url + "/metrics").text
    assert f'vllm:num_requests_waiting{{model_name="{MODEL}"}}' in text
    assert "# TYPE vllm:time_to_first_token_seconds histogram\n" in text
    promtool_check(text)
    accept = "application/openmetrics-text;version=1.0.0"
    open_text = httpx.get(llm_server.url + "/metrics", headers={"accept": accept}).text
    assert f'vllm:num_requests_waiting{{model_name="{MODEL}"}}' in open_text
    assert "vllm_" not in open_text  # ':' is kept, as vLLM writes it


@pytest.mark.parametrize(
    ("flag", "triton", "vllm"),
    [("triton,vllm", True, True), ("vllm", False, True), ("none", False, False)],
)
def test_metrics_compat_chooses_the_names(flag: str, triton: bool, vllm: bool) -> None:
    """--metrics-compat, in process: a classic model's Triton names and a language model's
    vLLM names are on /metrics or not, as the flag says; lockgate's own always."""
    models = ModelManager(Registry())
    classic = ModelConfig("classic", "python")
    models.models["classic"] = ServedModel("classic", NOWHERE, classic, {1: ready(classic)})
    service = served(AsyncLLMEngine(make_engine()))
    llm = ready(ModelConfig("fake", "llm"))
    llm.service = service
    models.models["fake"] = ServedModel("fake", NOWHERE, llm.config, {1: llm})
    compat = _metrics_compat(flag)
    assert compat is not None
    app = App(models, ServerSettings(metrics_compat=compat))
    OpenAIRoutes(app)
    try:
        text = models.registry.exposition()[0].decode()
    finally:
        service.close()
    assert ('nv_inference_request_success{model="classic",version="1"}' in text) is triton
    assert ('vllm:num_requests_waiting{model_name="fake"}' in text) is vllm
    assert 'lockgate_llm_num_requests_waiting{model_name="fake"}' in text


def test_metrics_compat_refuses_an_unknown_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--metrics-compat", "triton,prometheus"]) == 2
    assert "--metrics-compat takes 'none' or names among triton, vllm" in capsys.readouterr().err
    assert _metrics_compat("none") == frozenset()
    assert _metrics_compat(" Triton ") == {"triton"}
    assert _metrics_compat("") is None


def ready(config: ModelConfig) -> ServedVersion:
    return ServedVersion(config, 1, NOWHERE, NOWHERE, state=ModelState.READY)


def test_the_gates_readings_of_the_event_loop_are_gauges(server: RunningServer) -> None:
    """After some traffic: the loop's lag, its CPU per answer and its share of its core."""
    body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                        "data": digits_rows(1).ravel().tolist()}]}  # fmt: skip
    with httpx.Client(base_url=server.url) as client:
        for _ in range(60):  # more than one 100 ms window of answers
            assert client.post("/v2/models/digits_onnx/infer", json=body).is_success
            time.sleep(0.004)
    after = scraped(server)
    assert 0.0 <= after["lockgate_event_loop_lag_seconds"] < 1.0
    assert 0.0 < after["lockgate_event_loop_cpu_per_request_seconds"] < 0.05
    assert 0.0 < after["lockgate_event_loop_core_share"] <= 1.0
