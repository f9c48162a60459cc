"""The stored responses of the Responses API that a request needs, and where they live."""

from __future__ import annotations

from lockgate.router.response_homes import ResponseHomes, ResponseRequest


def test_a_responses_request_names_the_stored_response_it_needs() -> None:
    parse = ResponseRequest.parse
    assert parse("POST", "/v1/responses", b'{"input": "hi"}') == ResponseRequest(None, True)
    body = b'{"input": "hi", "previous_response_id": "resp_1"}'
    assert parse("POST", "/v1/responses", body) == ResponseRequest("resp_1", True)
    bad = b'{"previous_response_id": 7}'
    assert parse("POST", "/v1/responses", bad) == ResponseRequest(None, True)
    assert parse("GET", "/v1/responses/resp_2", b"") == ResponseRequest("resp_2")
    assert parse("DELETE", "/v1/responses/resp_2", b"") == ResponseRequest("resp_2", deletes=True)
    assert parse("GET", "/v1/responses", b"") is None
    assert parse("GET", "/v1/responses/r/input_items", b"") == ResponseRequest("r")
    assert parse("POST", "/v1/responses/r/cancel", b"") == ResponseRequest("r")
    assert parse("GET", "/v1/responses/a/b", b"") is None
    assert parse("POST", "/v1/responses/r/input_items", b"") is None


def test_the_table_is_bounded_and_forgets_deleted_responses() -> None:
    homes = ResponseHomes(size=2)
    for rid in ("a", "b", "c"):
        homes.keep(rid, "http://r")
    assert homes.home("a") is None and homes.home("c") == "http://r"
    homes.forget("c")
    assert homes.home("c") is None and len(homes) == 1
    assert len(ResponseHomes(size=0)) == 0
