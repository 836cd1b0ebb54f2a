"""KV tiers through the server: tenant isolation holds in the host tier, and the tier metrics."""

from __future__ import annotations

import textwrap

import httpx
import openai
import pytest

from pagoda.serve.admission.tenants import TenantRegistry
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

KEYS_FILE = """
tenants:
  alice: {api_keys: [key-alice]}
  bob: {api_keys: [key-bob]}
"""
SHARED_PROMPT = (
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"
) * 3
FILLER = "def handler_{i}(event, context):\n    return process(event['body'], retries={i})\n" * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    root = tmp_path_factory.mktemp("kvtiers")
    keys = root / "keys.yaml"
    keys.write_text(textwrap.dedent(KEYS_FILE))
    # 8 device blocks: one filler prompt evicts every earlier prefix from the device pool.
    live = start_server(
        build_tiny_model(root / "model"),
        tenants=TenantRegistry.from_file(keys),
        engine={"num_kv_blocks": 8, "max_num_seqs": 1, "kv_offload_memory": "4MiB"},
    )
    yield live
    live.stop()


def complete(server: LiveServer, key: str, prompt: str):
    client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)


def metric(server: LiveServer, name: str, label: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{label}}} not exported")


def evict_device(server: LiveServer, key: str, round_: int) -> None:
    for i in range(2):
        assert complete(server, key, FILLER.format(i=f"{round_}{i}")).usage.prompt_tokens > 90


def test_tenant_never_hits_another_tenants_host_block(server: LiveServer) -> None:
    first = complete(server, "key-alice", SHARED_PROMPT)
    assert first.usage.prompt_tokens > 48 and first.usage.prompt_tokens_details.cached_tokens == 0
    evict_device(server, "key-alice", 0)
    assert metric(server, "pagoda:kv_offload_usage_perc", 'tier="host"') > 0

    host_hits = metric(server, "pagoda:kv_offload_hits_total", 'tier="host"')
    bob = complete(server, "key-bob", SHARED_PROMPT)  # same tokens, other salt
    assert bob.usage.prompt_tokens_details.cached_tokens == 0
    assert metric(server, "pagoda:kv_offload_hits_total", 'tier="host"') == host_hits

    evict_device(server, "key-bob", 1)
    alice = complete(server, "key-alice", SHARED_PROMPT)
    cached = alice.usage.prompt_tokens_details.cached_tokens
    assert cached >= 48
    # The device pool was flushed by the fillers: the hit came from the host tier.
    assert metric(server, "pagoda:kv_offload_hits_total", 'tier="host"') >= host_hits + cached
    assert metric(server, "pagoda:kv_transfer_bytes_total", 'direction="device_to_host"') > 0
    assert metric(server, "pagoda:kv_transfer_bytes_total", 'direction="host_to_device"') > 0
    assert metric(server, "pagoda:num_requests_swapped", "model_name") == 0
    assert metric(server, "pagoda:num_preemptions_total", 'mode="recompute"') >= 0
    stats = server.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.kv_tiers.num_swapped == 0
