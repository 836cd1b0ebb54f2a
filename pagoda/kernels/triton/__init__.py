"""pagoda's Triton kernels (CUDA), all of them: paged attention and its KV codec, the fused MoE,
the w8a16/w4a16 weight products and the LoRA delta. Each module imports triton at its top, so
importing one raises ImportError where triton is not installed (the `gpu` extra); kernels/
imports them on first use and only on CUDA."""
