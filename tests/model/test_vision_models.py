"""Vision-language models (LLaVA; Qwen2.5-VL with its M-RoPE positions and window attention;
Qwen3-VL with interleaved M-RoPE and DeepStack;
Gemma 3 with its SigLIP tower, whose image tokens attend to each other both ways)
against transformers on the same weights (float32): greedy ids equal and logprobs within
LOGPROB_TOLERANCE, for prompts with one and several images of several sizes and
aspect ratios (generated PNG and JPEG files, decoded by pagoda.media.decode), batched with
text-only prompts; with chunked prefill cutting through image tokens, under preemption, with a
small encoder budget; the prefix cache never shares KV between two different images; the
encoder cache skips a repeated image (salted per tenant).

The reference is transformers' model fed the image processor's pixels (PIL backend) and the
prompt with its placeholders expanded as pagoda expands them (the processors do the same).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_helpers import assert_idle
from model_factory import build_vision_model
from pagoda import LLM, SamplingParams
from pagoda.media.decode import ImageLimits, decode_image

PIL = pytest.importorskip("PIL.Image")

NEW_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
SETTINGS = {
    "default": dict(),
    # 16-token images cut across 6-token chunks, each chunk taking its slice of the features
    "chunked": dict(max_num_batched_tokens=6, block_size=4),
    # one image per step: a prompt's second image waits for the next step's budget
    "encoder-budget": dict(max_num_encoder_tokens=16, block_size=4),
    "preemption": dict(block_size=4, num_kv_blocks=32, enable_prefix_caching=False),
    # an encoder cache too small to keep an image between steps: each chunk encodes it again
    "evicting-encoder-cache": dict(encoder_cache_tokens=1, max_num_batched_tokens=6, block_size=4),
}
ARCHITECTURES = ("llava", "qwen2_5_vl", "qwen3_vl", "gemma3_vl")
# One image in a prompt's text, before expansion.
PLACEHOLDERS = {
    "llava": "<image>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3_vl": "<start_of_image>",
}
# The token each image row stands on (what an expanded prompt holds).
IMAGE_TOKENS = {
    "llava": "<image>",
    "qwen2_5_vl": "<|image_pad|>",
    "qwen3_vl": "<|image_pad|>",
    "gemma3_vl": "<image_soft_token>",
}
HF_CLASSES = {
    "llava": "LlavaForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "gemma3_vl": "Gemma3ForConditionalGeneration",
}


def image_file(width: int, height: int, fmt: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    # smooth gradients plus noise: JPEG keeps them recognisable, resizing has something to average
    x = np.linspace(0, 1, width)[None, :, None]
    y = np.linspace(0, 1, height)[:, None, None]
    base = np.concatenate([x + 0 * y, y + 0 * x, (x + y) / 2], axis=2)
    pixels = np.clip(base * 200 + rng.normal(0, 30, (height, width, 3)), 0, 255).astype("uint8")
    out = io.BytesIO()
    PIL.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


@pytest.fixture(scope="module")
def images():
    """Decoded the way every API decodes them: wide PNG, tall JPEG, tiny square PNG, large JPEG."""
    files = [(60, 40, "PNG", 1), (30, 64, "JPEG", 2), (17, 17, "PNG", 3), (97, 51, "JPEG", 4)]
    return [decode_image(image_file(w, h, fmt, seed), ImageLimits()) for w, h, fmt, seed in files]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    return build_vision_model(tmp_path_factory.mktemp("vision") / arch, arch)


@pytest.fixture(scope="module")
def hf(model_dir: Path, arch: str):
    transformers = pytest.importorskip("transformers")
    model = getattr(transformers, HF_CLASSES[arch]).from_pretrained(model_dir).eval()
    return model, transformers.AutoImageProcessor.from_pretrained(model_dir)


def hf_greedy(hf, prompt_ids: list[int], images: list) -> tuple[list[int], list[float]]:
    """transformers' model fed its image processor's pixels (Qwen2.5-VL: and the grids and
    token types its processor would give)."""
    model, processor = hf
    kwargs = {}
    if images:
        inputs = processor(images=images, return_tensors="pt")
        kwargs["pixel_values"] = inputs["pixel_values"]
        if "image_grid_thw" in inputs:
            kwargs["image_grid_thw"] = inputs["image_grid_thw"]
            kwargs["mm_token_type_ids"] = (torch.tensor([prompt_ids]) == model.config.image_token_id).int()
        if getattr(model.config, "boi_token_index", None) is not None:  # Gemma 3: images attend both ways
            kwargs["token_type_ids"] = (torch.tensor([prompt_ids]) == model.config.image_token_index).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt_ids]),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **kwargs,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return tokens, [torch.log_softmax(logits[0].float(), -1)[t].item() for logits, t in zip(out.logits, tokens)]


def vision_prompts(images, arch: str) -> list:
    image = PLACEHOLDERS[arch]
    return [
        {"prompt": f"<|user|>Describe {image} please", "multi_modal_data": {"image": images[0]}},
        {
            "prompt": f"<|user|>Compare {image} with {image}, then",
            "multi_modal_data": {"image": [images[1], images[2]]},
        },
        "<|user|>The quick brown fox jumps over the lazy dog",
        {"prompt": f"{image}def fibonacci(n):", "multi_modal_data": {"image": [images[3]]}},
    ]


def prompt_images(prompt) -> list:
    if isinstance(prompt, str):
        return []
    value = prompt["multi_modal_data"]["image"]
    return value if isinstance(value, list) else [value]


def assert_matches(outputs, prompts, hf) -> None:
    for output, prompt in zip(outputs, prompts, strict=True):
        tokens, logprobs = hf_greedy(hf, output.prompt_token_ids, prompt_images(prompt))
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        got = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, logprobs)) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(arch, model_dir, images, hf, setting):
    prompts = vision_prompts(images, arch)
    llm = LLM(model=str(model_dir), kv_cache_memory="16MiB", **SETTINGS[setting])
    outputs = llm.generate(prompts, GREEDY)
    if arch == "llava":
        image_token = llm.engine.core.model_config.vision.image_token_id
        assert outputs[0].prompt_token_ids.count(image_token) == 16  # one per patch of the 32x32 tower input
        assert outputs[1].prompt_token_ids.count(image_token) == 32
    assert_matches(outputs, prompts, hf)
    if setting != "preemption":  # a second round: prefix-cache hits (and encoder-cache hits) change nothing
        assert_matches(llm.generate(prompts, GREEDY), prompts, hf)
    assert_idle(llm)


def test_two_images_never_share_kv(arch, model_dir, images, hf):
    """The same text around two different images: the second request's prefix-cache hit stops
    before the image, and each answer is its own image's."""
    llm = LLM(model=str(model_dir), kv_cache_memory="16MiB", block_size=4)
    text = f"<|user|>Describe this picture: {PLACEHOLDERS[arch]} in detail"
    first = {"prompt": text, "multi_modal_data": {"image": images[0]}}
    second = {"prompt": text, "multi_modal_data": {"image": images[3]}}
    out_first = llm.generate([first], GREEDY)
    out_second = llm.generate([second], GREEDY)
    image_offset = out_second[0].prompt_token_ids.index(llm.engine.core.model_config.vision.image_token_id)
    assert out_second[0].num_cached_tokens <= image_offset
    assert_matches(out_first + out_second, [first, second], hf)
    again = llm.generate([first], GREEDY)  # its own image hits its own blocks
    assert again[0].num_cached_tokens > image_offset
    assert_matches(again, [first], hf)


def test_encoder_cache_skips_a_repeated_image(arch, model_dir, images, hf):
    llm = LLM(model=str(model_dir), kv_cache_memory="16MiB", enable_prefix_caching=False)
    stats = llm.engine.core.scheduler.encoder_cache.stats
    prompt = {"prompt": f"<|user|>{PLACEHOLDERS[arch]} what is it", "multi_modal_data": {"image": images[1]}}
    llm.generate([prompt], GREEDY)
    assert (stats.images_encoded, stats.hits) == (1, 0)
    # the same image again (a later turn), and twice in one batch: encoded once in all
    outputs = llm.generate([prompt, prompt], GREEDY)
    assert (stats.images_encoded, stats.hits) == (1, 2)
    assert_matches(outputs, [prompt, prompt], hf)
    # another tenant's salt: its own entry
    llm.generate([prompt], GREEDY, cache_salt="tenant-b")
    assert stats.images_encoded == 2
    assert_idle(llm)


def test_image_requests_refused_when_malformed(arch, model_dir, images):
    from pagoda.errors import InvalidRequest

    llm = LLM(model=str(model_dir), kv_cache_memory="16MiB")
    with pytest.raises(InvalidRequest, match="placeholders"):
        llm.generate([{"prompt": "no placeholder here", "multi_modal_data": {"image": images[0]}}], GREEDY)
    with pytest.raises(InvalidRequest, match="without their image"):
        llm.generate([f"{IMAGE_TOKENS[arch]} an image token without its image"], GREEDY)
    assert_idle(llm)


def test_generate_command_takes_an_image(arch, model_dir, images, hf, tmp_path, capsys):
    from pagoda.cli import main

    path = tmp_path / "picture.jpg"
    images[1].save(path, format="JPEG")
    argv = ["generate", "--model", str(model_dir), "--prompt", "Describe", "--image", str(path), "--json"]
    argv += ["--max-tokens", str(NEW_TOKENS), "--temperature", "0", "--ignore-eos", "--kv-cache-memory", "16MiB"]
    assert main(argv) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[-1])
    # the same prompt offline: the placeholder before the text
    llm = LLM(model=str(model_dir), kv_cache_memory="16MiB")
    prompt = {
        "prompt": f"{PLACEHOLDERS[arch]}Describe",
        "multi_modal_data": {"image": decode_image(path.read_bytes(), ImageLimits())},
    }
    assert line["completions"][0]["text"] == llm.generate([prompt], GREEDY)[0].outputs[0].text
    bad = tmp_path / "not-an-image.png"
    bad.write_bytes(b"no image here")
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--image", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "format" in err, err


def test_disaggregation_is_refused_at_start(model_dir):
    from pagoda.config import EngineConfig
    from pagoda.engine.engine_core import EngineCore

    with pytest.raises(ValueError, match="disaggregation"):
        EngineCore(EngineConfig(model=str(model_dir), role="prefill", kv_cache_memory="16MiB", max_num_seqs=4))


def test_gemma3_prompts_are_tokenized_as_its_processor_writes_them(tmp_path_factory, images):
    """Gemma3Processor replaces <start_of_image> in the text with "\\n\\n<start_of_image>" + the
    image tokens + "<end_of_image>\\n\\n" and tokenizes the result: pagoda's ids are those."""
    model_dir = build_vision_model(tmp_path_factory.mktemp("gemma3_text") / "gemma3_vl", "gemma3_vl")
    llm = LLM(model=str(model_dir), kv_cache_memory="16MiB")
    vision = llm.engine.core.model_config.vision
    count = vision.options["mm_tokens_per_image"]
    text = "<|user|>Describe\n<start_of_image>please"
    ids, _ = llm._with_images(text, [images[0]])
    processor_text = text.replace(
        "<start_of_image>", "\n\n<start_of_image>" + "<image_soft_token>" * count + "<end_of_image>\n\n"
    )
    assert ids == llm.tokenizer.encode(processor_text)
    assert llm.media_processor.prepare_text("a<start_of_image>b") == "a\n\n<start_of_image>\n\nb"
