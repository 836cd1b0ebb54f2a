"""Images in: what a request's media become before the engine sees them.

`decode` turns a client's bytes into an RGB image safely (Pillow, PNG/JPEG/WebP/GIF only, byte,
pixel and decompression-bomb caps); `sources` reads an image part's URL (data URLs always,
http(s) only from allowed domains); `processor` runs the model's image processor (transformers'
PIL backend) and expands each image's placeholder into one token per feature row, giving the
prompt ids and the request's MediaItems (pagoda.media_item). The server's endpoints and the
offline LLM share them; the engine takes the result (EngineRequest.media).
"""
