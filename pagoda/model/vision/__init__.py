"""Vision encoders: a vision tower and the projector into the decoder's embedding space.

An encoder turns one preprocessed image (pagoda.media_item.MediaItem's pixels and grid) into the
rows that replace the image's placeholder tokens' embeddings in the prompt (one row per
placeholder token). A vision-language family's model (pagoda.model.families) holds one as
`vision`; the model runner calls `encode` in the engine's encoder step and caches what it
returns (pagoda.core.encoder_cache). `encoder` holds the interface and the activations;
`clip` LLaVA's CLIP tower and projector, `siglip` Gemma 3's SigLIP tower and pooling projector,
`qwen` Qwen2.5-VL's and Qwen3-VL's vision transformers. Their projections are pagoda's Linear
(full precision, unsplit), so checkpoints' q/k/v load into one fused projection like the
decoder's.
"""
