"""/metrics of a real server after KServe v2 and language-model traffic: valid for promtool,
in the text format 0.0.4 or, when asked, OpenMetrics."""

from __future__ import annotations

import httpx
import openai

from tests.conftest import RunningServer
from tests.core.test_metrics import promtool_check

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
