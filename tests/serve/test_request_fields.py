"""Walk the request-field table through the server: refused fields are 400s naming them,
ignored ones change nothing, and inert values of refused fields are accepted."""

from __future__ import annotations

import httpx
import pytest

from pagoda.serve.api.request_fields import Support
from pagoda.serve.endpoints import ENDPOINTS
from server_utils import LiveServer, build_tiny_model, start_server

# The endpoints walked through the server, by name: the path and field table are the endpoint table's.
BODIES = {
    "completions": {"prompt": "hello", "max_tokens": 2, "temperature": 0},
    "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0},
    "responses": {"input": "hi", "max_output_tokens": 2, "temperature": 0, "store": False},
}
BASES = {endpoint.name: (endpoint.path, BODIES[endpoint.name]) for endpoint in ENDPOINTS if endpoint.name in BODIES}
TABLES = {endpoint.name: endpoint.fields for endpoint in ENDPOINTS if endpoint.name in BODIES}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    live = start_server(build_tiny_model(tmp_path_factory.mktemp("model")))
    yield live
    live.stop()


def cases(support: Support) -> list[tuple[str, str]]:
    return [
        (endpoint, name)
        for endpoint, table in TABLES.items()
        for name, field in table.items()
        if field.support is support
    ]


@pytest.mark.parametrize("endpoint, name", cases(Support.REFUSED))
def test_refused_fields_are_400s_naming_them(server: LiveServer, endpoint: str, name: str) -> None:
    path, base = BASES[endpoint]
    field = TABLES[endpoint][name]
    assert field.example is not None and field.why
    response = httpx.post(server.url + path, json={**base, name: field.example}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name and error["code"] == "unsupported_field"
    assert field.why in error["message"]


def test_ignored_fields_do_not_change_the_output(server: LiveServer) -> None:
    for endpoint, (path, base) in BASES.items():
        plain = httpx.post(server.url + path, json=base, timeout=30).json()
        extras = {name: field.example for name, field in TABLES[endpoint].items() if field.support is Support.IGNORED}
        assert extras and all(v is not None for v in extras.values())
        response = httpx.post(server.url + path, json={**base, **extras}, timeout=30)
        assert response.status_code == 200, response.text
        if endpoint == "responses":
            assert response.json()["output"][0]["content"] == plain["output"][0]["content"]
            continue
        key = "text" if endpoint == "completions" else "message"
        assert response.json()["choices"][0][key] == plain["choices"][0][key]


def test_inert_values_of_refused_fields_are_accepted(server: LiveServer) -> None:
    path, base = BASES["chat"]
    inert = {"use_beam_search": False, "functions": [], "function_call": "none", "chat_template": None, "echo": False}
    assert httpx.post(server.url + path, json={**base, **inert}, timeout=30).status_code == 200
    path, base = BASES["completions"]
    assert (
        httpx.post(server.url + path, json={**base, "suffix": "", "use_beam_search": False}, timeout=30).status_code
        == 200
    )


def test_every_request_model_field_is_in_the_table() -> None:
    for endpoint in ENDPOINTS:
        if endpoint.fields is None:
            continue
        model = endpoint.request_model
        missing = set(model.model_fields) - set(endpoint.fields)
        assert not missing, f"{model.__name__} fields missing from the table: {sorted(missing)}"
