"""One tenant's flood of stored responses evicts its own, never another tenant's: the tenant
holding the most entries loses its oldest when the store is full."""

from __future__ import annotations

import textwrap

import httpx

from pagoda.serve.admission.tenants import TenantRegistry
from pagoda.serve.api.responses_store import ResponsesStore
from server_utils import MODEL_NAME, build_tiny_model, start_server


def test_the_largest_holder_is_evicted_first() -> None:
    store = ResponsesStore(max_entries=4, ttl_s=100)
    store.put("a1", "alice", [], {"id": "a1"})
    for index in range(50):
        store.put(f"b{index}", "bob", [], {"id": f"b{index}"})
    assert store.get("alice", "a1").body == {"id": "a1"}
    assert store.tenant_count("bob") == 3 and len(store) == 4
    store.delete("alice", "a1")
    assert store.tenant_count("alice") == 0


def test_a_flooding_tenant_cannot_evict_another_tenants_responses(tmp_path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        textwrap.dedent("""
        tenants:
          alice: {api_keys: [key-alice]}
          mallory: {api_keys: [key-mallory]}
    """)
    )
    live = start_server(
        build_tiny_model(tmp_path / "model"), tenants=TenantRegistry.from_file(keys), responses_store_size=4
    )
    try:

        def respond(key: str, **body) -> httpx.Response:
            return httpx.post(
                live.url + "/v1/responses",
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
                json={"model": MODEL_NAME, "input": "hi", "max_output_tokens": 1, **body},
            )

        kept = respond("key-alice")
        assert kept.status_code == 200, kept.text
        for _ in range(12):
            assert respond("key-mallory").status_code == 200
        follow_up = respond("key-alice", previous_response_id=kept.json()["id"])
        assert follow_up.status_code == 200, follow_up.text
    finally:
        live.stop()
