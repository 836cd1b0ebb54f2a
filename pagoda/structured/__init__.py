"""Structured output: grammar-constrained decoding on llguidance.

params      StructuredOutputsParams (what a request asks for; no heavy imports)
grammar     request constraint -> llguidance grammar text, validated (errors name the field)
compiler    compile cache keyed by (constraint, tokenizer), compiling in a thread pool
matcher     the per-request matcher that advances with each accepted token
bitmask     the batch token bitmask, applied to the logits in one operation
manager     what the engine core calls: submit, poll, fill masks, accept tokens, stats
"""

from pagoda.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
