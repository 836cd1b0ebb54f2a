"""A tiny deterministic guard model for the classifier guardrail tests.

A one-layer Llama whose weights are set by hand (not trained, not random): its greedy next
token is `UNSAFE_LABEL` when the prompt contains the trigger token anywhere, else
`SAFE_LABEL`. One attention head looks for the trigger: every query has the same large
component, only the trigger's key matches it, and the trigger's value writes an "unsafe"
direction into the last position's residual, which the LM head reads. The query/key pair
sits in the lowest RoPE frequency, so position barely changes the score.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from pagoda.config import DEFAULT_MODEL_DIR

TRIGGER = " kill"  # one token of the bundled tokenizer
SAFE_LABEL, UNSAFE_LABEL = "OK", "BAD"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_guard_model(directory: Path) -> Path:
    import transformers

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))

    def single_token(text: str) -> int:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"{text!r} is not one token of the bundled tokenizer: {ids}")
        return ids[0]

    trigger, safe, unsafe = single_token(TRIGGER), single_token(SAFE_LABEL), single_token(UNSAFE_LABEL)
    hidden, head_dim = 64, 16
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    model = transformers.LlamaForCausalLM(config)
    low = head_dim // 2 - 1  # rotated with low + head_dim/2 at the lowest frequency
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
        model.model.embed_tokens.weight[:, 0] = 1.0  # a constant direction
        model.model.embed_tokens.weight[trigger, 2] = 1.0  # the trigger's own direction
        attention = model.model.layers[0].self_attn
        attention.q_proj.weight[low, 0] = 2.0  # head 0 query: the constant direction
        attention.k_proj.weight[low, 2] = 2.0  # kv head 0 key: only the trigger has it
        attention.v_proj.weight[0, 2] = 1.0  # value: the trigger's direction
        attention.o_proj.weight[1, 0] = 2.0  # -> the "unsafe" direction of the residual
        model.lm_head.weight[safe, 0] = 1.0
        model.lm_head.weight[unsafe, 1] = 1.0
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, directory / name)
    return directory
