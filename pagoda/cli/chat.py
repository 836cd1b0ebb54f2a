"""`pagoda chat`: an interactive terminal chat with streamed replies."""

from __future__ import annotations

import argparse
import sys

from pagoda.cli.model_flag import use_chat_model_default
from pagoda.cli.sampling_flags import add_sampling_args, sampling_params_from_args
from pagoda.config import EngineConfig

HELP = "Type a message and press Enter. /reset clears the conversation, /exit (or Ctrl-D) quits."


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="interactive chat in the terminal",
        description="Chat with a model in the terminal; replies stream as they are generated.",
    )
    parser.add_argument("--system", default=None, help="system message to start the conversation with")
    add_sampling_args(parser, default_max_tokens=256)
    # --seed is the request's seed here; the engine keeps its default.
    EngineConfig.add_cli_args(parser, skip=("seed",))
    use_chat_model_default(parser)
    parser.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    from pagoda.engine.llm import LLM

    try:
        llm = LLM(**vars(EngineConfig.from_cli_args(args, skip=("seed",))))
    except ValueError as error:  # bad model / quantization input: one line, no traceback
        print(f"pagoda chat: {error}", file=sys.stderr)
        return 2
    if not llm.tokenizer.has_chat_template:
        print("pagoda chat: this model has no chat template", file=sys.stderr)
        return 2
    try:
        params = sampling_params_from_args(args, llm.engine.generation_defaults)
    except ValueError as error:
        print(f"pagoda chat: {error}", file=sys.stderr)
        return 2
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    if interactive:
        print(HELP)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            messages = list(start)
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": line})
        try:
            prompt = llm.tokenizer.encode_chat(messages)
            reply = []
            for delta in llm.stream(prompt, params):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except ValueError as error:
            messages.pop()
            print(f"\n[error] {error}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
