"""Operations tools that judge a deployment over HTTP: `pagoda gate` (release gate) and
`pagoda audit` (side-channel audit). They talk to any OpenAI-compatible server and import no
engine code, so they work against pagoda, vLLM or llama.cpp alike."""
