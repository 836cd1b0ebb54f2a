"""Images through every API of a served vision-language model: chat `image_url` parts (data URLs),
Responses `input_image` and Anthropic base64 `image` blocks give the answer the offline engine
gives for the same rendered prompt and image; a repeated image in a later turn skips the
encoder; every refusal (bad data, not an image, too large, too many, a URL without
--allowed-media-domains, an image to a text-only model) is a 400 in the endpoint's own error
shape, and the server stays healthy."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import pytest

from model_factory import build_vision_model
from pagoda import LLM, SamplingParams
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

PIL = pytest.importorskip("PIL.Image")
NEW_TOKENS = 8


def image_bytes(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    PIL.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PNG = image_bytes(40, 30, "PNG", 1)
JPEG = image_bytes(23, 57, "JPEG", 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_model(tmp_path_factory.mktemp("vision_server") / "llava", "llava")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> LiveServer:
    live = start_server(
        model_dir,
        engine={"enable_prefix_caching": False, "num_kv_blocks": 128},
        max_image_pixels=200_000,
        max_images_per_request=3,
    )
    yield live
    live.stop()


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, str]:
    """The offline engine's greedy text for "Describe\\n<image>" with each image."""
    llm = LLM(model=str(model_dir), kv_cache_memory="16MiB")
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Describe\n<image>"}], tokenize=False, add_generation_prompt=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    answers = {}
    for name, data in (("png", PNG), ("jpeg", JPEG)):
        image = PIL.open(io.BytesIO(data)).convert("RGB")
        answers[name] = (
            llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}], params)[0].outputs[0].text
        )
    return answers


def chat(server: LiveServer, content, **extra) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS}
    body.update(temperature=0.0, ignore_eos=True, **extra)
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_image_url_matches_offline(server, expected):
    for name, data, media_type in (("png", PNG, "image/png"), ("jpeg", JPEG, "image/jpeg")):
        response = chat(server, [{"type": "text", "text": "Describe"}, image_part(data_url(data, media_type))])
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == expected[name]
    assert server.wait_idle().num_running == 0


def test_responses_input_image(server, expected):
    body = {
        "model": MODEL_NAME,
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Describe"},
                    {"type": "input_image", "image_url": data_url(PNG)},
                ],
            }
        ],
        "max_output_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{server.base_url}/responses", json=body, timeout=60)
    assert response.status_code == 200, response.text
    message = next(item for item in response.json()["output"] if item["type"] == "message")
    assert message["content"][0]["text"] == expected["png"]


def test_anthropic_base64_image(server, expected):
    source = {"type": "base64", "media_type": "image/jpeg", "data": base64.b64encode(JPEG).decode()}
    body = {
        "model": MODEL_NAME,
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "image", "source": source}]}
        ],
    }
    response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["content"][0]["text"] == expected["jpeg"]


def test_a_repeated_image_skips_the_encoder(server):
    """A later turn sending the same image again: the encoder cache answers it (and /metrics says so)."""
    content = [{"type": "text", "text": "Again"}, image_part(data_url(image_bytes(31, 31, "PNG", 9)))]
    first = chat(server, content)
    before = server.stats().encoder
    second = chat(server, content)
    after = server.stats().encoder
    assert first.status_code == second.status_code == 200
    assert first.json()["choices"][0]["message"]["content"] == second.json()["choices"][0]["message"]["content"]
    assert after.images_encoded == before.images_encoded and after.hits == before.hits + 1
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert f'pagoda:encoder_cache_hits_total{{model_name="{MODEL_NAME}"}} {float(after.hits)}' in metrics
    assert "pagoda:images_encoded_total" in metrics


def openai_error(response: httpx.Response, code: str | None = None) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if code is not None:
        assert error["code"] == code
    return error["message"]


@pytest.mark.parametrize(
    "url, code",
    [
        ("data:image/png;base64,!!!notbase64", "invalid_image_url"),
        (data_url(b"GIF89a but not really an image"), "invalid_image"),
        (data_url(b"plain text, no image at all"), "invalid_image"),
        (data_url(image_bytes(600, 400)), "image_too_large"),  # 240,000 pixels over the 200,000 cap
        ("data:text/plain;base64,aGVsbG8=", "invalid_image"),
        ("http://169.254.169.254/latest/meta-data", "image_url_not_allowed"),
        ("https://example.com/cat.png", "image_url_not_allowed"),  # no --allowed-media-domains
        ("file:///etc/passwd", "image_url_not_allowed"),
    ],
)
def test_chat_refusals_are_400s(server, url, code):
    message = openai_error(chat(server, [{"type": "text", "text": "x"}, image_part(url)]), code)
    assert "base64" not in message or code == "invalid_image_url"


def test_too_many_images_and_mismatched_placeholders(server):
    parts = [image_part(data_url(PNG))] * 4
    openai_error(chat(server, parts), "too_many_images")
    # a placeholder typed as text is one more placeholder than images
    openai_error(chat(server, [{"type": "text", "text": "<image> and"}, image_part(data_url(PNG))]))


def test_anthropic_and_responses_refusals_keep_their_shapes(server):
    body = {
        "model": MODEL_NAME,
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@@"}}],
            }
        ],
    }
    response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    body = {"model": MODEL_NAME, "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f1"}]}]}
    response = httpx.post(f"{server.base_url}/responses", json=body, timeout=60)
    assert response.status_code == 400 and "error" in response.json()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_text_model_refuses_images(tmp_path):
    live = start_server(build_tiny_model(tmp_path / "text"))
    try:
        openai_error(chat(live, [image_part(data_url(PNG))]), "images_not_supported")
    finally:
        live.stop()


def test_images_cross_the_process_transport(model_dir, expected):
    """The engine in its own process (pagoda serve's default): the request's pixels travel with it."""
    live = start_server(model_dir, transport="process", engine={"num_kv_blocks": 64})
    try:
        content = [{"type": "text", "text": "Describe"}, image_part(data_url(PNG))]
        response = chat(live, content)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == expected["png"]
        assert live.stats().encoder.images_encoded == 1
    finally:
        live.stop()


def test_no_image_bytes_in_the_logs(model_dir, tmp_path, caplog):
    """The prompt log holds the rendered messages (the placeholder where the image was); neither it
    nor any log line carries the image's bytes, even for a refused image."""
    import logging

    live = start_server(model_dir, log_prompts=True, prompt_log_dir=str(tmp_path / "log"))
    encoded = base64.b64encode(PNG).decode()
    try:
        with caplog.at_level(logging.DEBUG):
            assert chat(live, [image_part(data_url(PNG))]).status_code == 200
            bad = "data:image/png;base64," + base64.b64encode(b"\x89PNG broken" * 40).decode()
            assert chat(live, [image_part(bad)]).status_code == 400
    finally:
        live.stop()
    written = "".join(path.read_text() for path in (tmp_path / "log").rglob("*") if path.is_file())
    assert "<image>" in written and encoded[:64] not in written and bad[30:90] not in written
    assert all(encoded[:64] not in r.getMessage() and bad[30:90] not in r.getMessage() for r in caplog.records)


def test_a_stored_conversation_carries_its_image(server):
    """Responses' previous_response_id replays the earlier turn, image included: the second turn
    sees it again (and the encoder cache answers it)."""
    first = {
        "model": MODEL_NAME,
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Look"},
                    {"type": "input_image", "image_url": data_url(JPEG)},
                ],
            }
        ],
        "max_output_tokens": 4,
        "temperature": 0.0,
    }
    response = httpx.post(f"{server.base_url}/responses", json=first, timeout=60)
    assert response.status_code == 200, response.text
    before = server.stats().encoder
    second = {
        "model": MODEL_NAME,
        "previous_response_id": response.json()["id"],
        "input": "And now?",
        "max_output_tokens": 4,
        "temperature": 0.0,
    }
    response = httpx.post(f"{server.base_url}/responses", json=second, timeout=60)
    assert response.status_code == 200, response.text
    after = server.stats().encoder
    assert response.json()["usage"]["input_tokens"] > 16  # the image's tokens are in the prompt again
    assert after.images_encoded == before.images_encoded  # from the prefix or the encoder cache


def test_anthropic_count_tokens_counts_image_tokens(server):
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "Describe"}]}]}
    text_only = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, timeout=60).json()["input_tokens"]
    body["messages"][0]["content"].append({"type": "image", "source": source})
    with_image = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, timeout=60).json()["input_tokens"]
    assert with_image - text_only >= 16  # one token per patch, and the placeholder's neighbours


@pytest.mark.parametrize("architecture", ["qwen2_5_vl", "qwen3_vl", "gemma3_vl"])
def test_chat_images_for_every_family(tmp_path, architecture):
    """The chat path's placeholder (Qwen2.5-VL's vision_start/pad/end, Gemma 3's start_of_image)
    rendered, expanded and answered as the offline engine answers the same prompt."""
    model_dir = build_vision_model(tmp_path / architecture, architecture)
    llm = LLM(model=str(model_dir), kv_cache_memory="16MiB")
    placeholder = llm.engine.core.model_config.vision.image_placeholder
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": f"Describe\n{placeholder}"}], tokenize=False, add_generation_prompt=True
    )
    image = PIL.open(io.BytesIO(JPEG)).convert("RGB")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    offline = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}], params)[0].outputs[0].text
    live = start_server(model_dir, engine={"num_kv_blocks": 64})
    try:
        response = chat(live, [{"type": "text", "text": "Describe"}, image_part(data_url(JPEG, "image/jpeg"))])
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == offline
    finally:
        live.stop()
