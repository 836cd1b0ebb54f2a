"""Structured output: grammar-constrained decoding on llguidance.

StructuredOutputsParams (what a request asks for) is pagoda.sampling_params's, re-exported here.

grammar     request constraint -> llguidance grammar text, validated (errors name the field)
compiler    compile cache keyed by (constraint, tokenizer), compiling in a thread pool
matcher     the per-request matcher that advances with each accepted token
manager     what the engine core and runner call (the batch token bitmask itself, and applying it
            to the logits in one operation, is pagoda.kernels.bitmask);: submit, poll, GrammarMasks (filled during the
            forward), advance matchers, stats
cli_args    --json-schema / --regex / --choice / --grammar flags of `pagoda generate` and `chat`
"""

from pagoda.sampling_params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
