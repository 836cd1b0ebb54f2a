"""`pagoda generate`: run prompts through the engine offline and print the completions."""

from __future__ import annotations

import argparse
import json
import sys
import time

from pagoda.cli.model_flag import use_chat_model_default
from pagoda.cli.sampling_flags import add_sampling_args, sampling_params_from_args
from pagoda.config import EngineConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate completions offline (no server)",
        description="Generate completions for prompts with the engine, no server.",
    )
    parser.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeatable; several prompts run as one batch)"
    )
    parser.add_argument("--chat", action="store_true", help="treat each prompt as a user message (chat template)")
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="an image (PNG, JPEG, WebP, GIF) for a vision-language model, given to every prompt (repeatable); "
        "its placeholder goes before the text unless the prompt already holds one per image",
    )
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_sampling_args(parser, default_max_tokens=128)
    # --seed is the request's seed here; the engine keeps its default.
    EngineConfig.add_cli_args(parser, skip=("seed",))
    use_chat_model_default(parser)
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from pagoda.engine.llm import LLM

    try:
        llm = LLM(**vars(EngineConfig.from_cli_args(args, skip=("seed",))))
        params = sampling_params_from_args(args, llm.engine.generation_defaults, n=args.n)
        prompts: list = args.prompt
        images = [_read_image(path) for path in args.image]
        placeholder = _placeholder(llm, images)
        if images:  # the placeholders before the text, unless the prompt places them itself
            prompts = [p if p.count(placeholder) == len(images) else placeholder * len(images) + p for p in prompts]
        if args.chat and images:  # rendered, then tokenized as the checkpoint's processor would
            prompts = [
                llm.tokenizer.encode(
                    llm.media_processor.prepare_text(
                        llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                    ),
                    add_special_tokens=False,
                )
                for p in prompts
            ]
        elif args.chat:
            prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        if images:
            key = "prompt_token_ids" if args.chat else "prompt"
            prompts = [{key: p, "multi_modal_data": {"image": images}} for p in prompts]
        if len(prompts) == 1 and args.n == 1 and not args.json and not images:
            sys.stdout.write(args.prompt[0] if not args.chat else "")
            for delta in llm.stream(prompts[0], params):
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            return 0
        start = time.time()
        outputs = llm.generate(prompts, params)
    except (ValueError, OSError) as error:
        print(f"pagoda generate: {error}", file=sys.stderr)
        return 2
    for prompt, output in zip(args.prompt, outputs):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "completions": [
                            {"text": c.text, "finish_reason": c.finish_reason, "num_tokens": len(c.token_ids)}
                            for c in output.outputs
                        ],
                        "num_prompt_tokens": len(output.prompt_token_ids),
                        "num_cached_tokens": output.num_cached_tokens,
                    }
                )
            )
            continue
        for completion in output.outputs:
            print(f"--- prompt: {prompt!r} (sample {completion.index}, {completion.finish_reason})")
            print(prompt + completion.text if not args.chat else completion.text)
    if not args.json:
        print(f"--- {len(outputs)} prompt(s) in {time.time() - start:.2f}s", file=sys.stderr)
    return 0


def _read_image(path: str):
    """An --image file, through the same safe decoding as the server's images."""
    from pagoda.media.decode import ImageLimits, decode_image

    with open(path, "rb") as file:
        return decode_image(file.read(), ImageLimits(), param="image")


def _placeholder(llm, images: list) -> str:
    vision = llm.engine.core.model_config.vision
    if images and vision is None:
        raise ValueError("--image: this model takes no images (it is not a vision-language model)")
    return vision.image_placeholder if vision is not None else ""
