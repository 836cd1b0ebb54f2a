"""Phi-3: read as Mistral (a sliding window on every layer), with LongRoPE (`su`/`longrope`
rope scaling, pagoda.model.rope). Its checkpoints hold q/k/v and gate/up already fused
(`qkv_proj`, `gate_up_proj`): the loader takes a fused tensor whole."""

from __future__ import annotations

from pagoda.model.families import mistral

FAMILY = mistral.FAMILY
