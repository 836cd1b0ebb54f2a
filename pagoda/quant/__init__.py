"""Quantized serving: weight formats, KV cache dtypes, GGUF and quantized checkpoints."""
