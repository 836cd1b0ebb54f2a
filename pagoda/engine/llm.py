"""LLM: the offline front. `LLM(model=dir).generate(prompts, params)` runs them to completion."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from pagoda.config import DeploymentConfig, EngineConfig
from pagoda.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, beam_score
from pagoda.engine.commands import run_command
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.prompt_inputs import PromptInput, normalize_prompts, prompt_images
from pagoda.engine.roles import require_both_role
from pagoda.engine.scoring import class_probs, classify_params, pair_prompt, pair_score, score_pairs
from pagoda.engine.threads import set_engine_threads
from pagoda.errors import InvalidRequest
from pagoda.lora_request import LoRARequest
from pagoda.media.processor import MediaProcessor
from pagoda.media_item import MediaItem
from pagoda.model.classifier_config import ClassifierConfig
from pagoda.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    OutputAccumulator,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagoda.sampling_params import SamplingParams

Prompt = str | list[int]  # one prompt as the engine takes it


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """`engine_args`: EngineConfig fields. One offline engine has no replicas: a
        DeploymentConfig field (data_parallel_size, router, ...) is a ValueError."""
        deployment_args = sorted(set(engine_args) & {f.name for f in dataclasses.fields(DeploymentConfig)})
        if deployment_args:
            raise ValueError(
                f"{', '.join(deployment_args)}: deployment settings, not the offline LLM's "
                f"(serve replicas with pagoda serve)"
            )
        if model is not None:
            engine_args["model"] = model
        # Offline work wants throughput, not a per-token latency: --max-num-seqs defaults to what
        # the KV pool holds, without the serving engine's decode-step calibration.
        engine_args.setdefault("max_num_seqs_itl_ms", None)
        config = EngineConfig(**engine_args)
        require_both_role(config, "the offline LLM")
        # The offline engine steps on the caller's thread, with no event loop beside it.
        set_engine_threads(config, serving=False)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._media_processor: MediaProcessor | None = None  # built with the first image

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer, as vLLM's `LLM.get_tokenizer()` returns it."""
        return self.engine.tokenizer.hf

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in prompt order. A prompt is text, token ids,
        `{"prompt": text}` or `{"prompt_token_ids": ids}` (vLLM's TextPrompt / TokensPrompt).
        `lora_request`: one adapter for all prompts or one per prompt (None: the base model); an
        adapter not loaded yet is loaded from its path (needs enable_lora=True). A dict prompt's
        `multi_modal_data` ({"image": PIL image or list}) goes to a vision-language model."""
        images = prompt_images(prompts)
        prompts = normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(lora_request)} LoRA requests")
        request_ids = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            request_id = str(next(self._ids))
            media: tuple[MediaItem, ...] = ()
            if images[i]:
                prompt, media = self._with_images(prompt, images[i])
            self.engine.add_request(
                EngineRequest(
                    request_id,
                    prompt,
                    params,
                    cache_salt=cache_salt,
                    priority=priority[i] if priority else 0,
                    lora_request=lora_request[i],
                    media=media,
                )
            )
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    @property
    def media_processor(self) -> MediaProcessor:
        """The model's image preprocessing and placeholder expansion (built on first use)."""
        vision = self.engine.core.model_config.vision
        if vision is None:
            raise InvalidRequest("this model takes no images (it is not a vision-language model)", param="prompt")
        if self._media_processor is None:
            self._media_processor = MediaProcessor.from_pretrained(self.engine.config.model, vision)
        return self._media_processor

    def _with_images(self, prompt: Prompt, images: list[Any]) -> tuple[list[int], tuple[MediaItem, ...]]:
        """The prompt's ids with each image's placeholder expanded, and its images as items. A
        text prompt is tokenized as the checkpoint's processor would (MediaProcessor.prepare_text)."""
        processor = self.media_processor
        ids = self.tokenizer.encode(processor.prepare_text(prompt)) if isinstance(prompt, str) else prompt
        return processor.expand(ids, [image.convert("RGB") for image in images])

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (vLLM's `LLM.beam_search`): each output holds the
        `beam_width` best sequences, best first. `concurrency_limit`: at most this many prompts
        searched at once (None: all)."""
        prompts = normalize_prompts(prompts)
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        sampling_params = params.sampling_params()
        chunk = concurrency_limit or max(len(prompts), 1)
        outputs: list[RequestOutput] = []
        for start in range(0, len(prompts), chunk):
            outputs += self.generate(
                prompts[start : start + chunk],
                sampling_params,
                use_tqdm=use_tqdm,
                lora_request=lora_request[start : start + chunk],
            )
        return [
            BeamSearchOutput(
                [
                    BeamSearchSequence(
                        tokens=output.prompt_token_ids + sample.token_ids,
                        logprobs=sample.logprobs or [],
                        cum_logprob=sample.cumulative_logprob or 0.0,
                        text=sample.text,
                        finish_reason=sample.finish_reason,
                        stop_reason=sample.stop_reason,
                        score=beam_score(
                            sample.cumulative_logprob or 0.0, len(sample.token_ids), params.length_penalty
                        ),
                    )
                    for sample in output.outputs
                ]
            )
            for output in outputs
        ]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """Score pairs on a classifier model (vLLM's `LLM.score`): one text_1 against every
        text_2, or lists paired one to one; one output per pair, in order."""
        classifier = self._classifier()
        pairs = score_pairs(text_1, text_2)
        prompts = [{"prompt_token_ids": pair_prompt(self.tokenizer, classifier, a, b)} for a, b in pairs]
        outputs = self.generate(prompts, classify_params(), use_tqdm=use_tqdm, lora_request=lora_request)
        return [
            ScoringRequestOutput(
                output.request_id, ScoringOutput(pair_score(self._logits(output), classifier)), output.prompt_token_ids
            )
            for output in outputs
        ]

    def classify(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities of each prompt on a classifier model (vLLM's `LLM.classify`)."""
        self._classifier()
        outputs = self.generate(prompts, classify_params(), use_tqdm=use_tqdm, lora_request=lora_request)
        return [
            ClassificationRequestOutput(
                output.request_id, ClassificationOutput(class_probs(self._logits(output))), output.prompt_token_ids
            )
            for output in outputs
        ]

    def _classifier(self) -> ClassifierConfig:
        classifier = self.engine.classifier
        if classifier is None:
            raise ValueError(
                "this model has no classifier head: scoring and classification need a "
                "*ForSequenceClassification checkpoint or score_tokens (e.g. 'no,yes')"
            )
        return classifier

    @staticmethod
    def _logits(output: RequestOutput) -> list[float]:
        assert output.embedding is not None  # a finished "classify" pooling request carries them
        return output.embedding

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text as it is released (the first sample's)."""
        request_id = str(next(self._ids))
        self.engine.add_request(
            EngineRequest(request_id, prompt, sampling_params or self.get_default_sampling_params())
        )
        try:
            while True:
                output = self.engine.step()
                if request_id in output.refused:  # its grammar failed
                    raise output.refused[request_id]
                for delta in output.deltas:
                    if delta.request_id != request_id:
                        continue
                    text = "".join(sample.text for sample in delta.outputs if sample.index == 0)
                    if text:
                        yield text
                    if delta.finished:
                        return
        finally:
            self.engine.abort_request([request_id])

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = False,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate the reply.
        `tools` (OpenAI function tools) are passed to the template, as vLLM's LLM.chat does."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        extra = {"tools": tools} if tools else {}
        prompts = [self.tokenizer.encode_chat(conversation, **extra) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ---- weight updates and sleep (vLLM's LLM.sleep / wake_up, SGLang's update_weights_from_disk) ----

    def update_weights_from_disk(self, model_path: str) -> None:
        """Load new weights for the model from a safetensors directory, all or nothing; raises
        InvalidRequest with the reason (the old weights keep serving). Cached prefixes are dropped."""
        run_command(self.engine, "update_weights_from_disk", {"model_path": str(model_path)})

    def sleep(self, level: int = 1) -> None:
        """Release the KV pool's memory (level 1) and the weights' too (level 2) until wake_up."""
        run_command(self.engine, "sleep", {"level": level})

    def wake_up(self) -> None:
        run_command(self.engine, "wake_up", {})

    @property
    def is_sleeping(self) -> bool:
        return bool(self.engine.sleep_mode.level)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        if self.engine.sleep_mode.level:
            self.engine.abort_request(request_ids)
            raise InvalidRequest("the engine is asleep: call wake_up() first")
        pending = set(request_ids)
        outputs = OutputAccumulator()
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="generate", unit="req")
        while pending:
            step = self.engine.step()
            failed = [error for request_id, error in step.refused.items() if request_id in pending]
            if failed:  # a grammar failed to compile in time: nothing else of this call is kept
                self.engine.abort_request(pending)
                raise failed[0]
            for delta in step.deltas:
                if delta.request_id not in pending:
                    continue
                output = outputs.add(delta)
                if output.finished:
                    pending.discard(delta.request_id)
                    finished[delta.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [finished[request_id] for request_id in request_ids]
