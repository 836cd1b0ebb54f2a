"""pagoda: an LLM inference server."""

from pagoda.engine.threads import prefer_passive_omp_wait

# Before anything imports torch: see pagoda/engine/threads.py (the OpenMP thread trap).
prefer_passive_omp_wait()

from pagoda.sampling_params import SamplingParams  # noqa: E402

__all__ = ["SamplingParams", "LLM"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so `pagoda --help` stays fast.
    if name == "LLM":
        from pagoda.engine.llm import LLM

        return LLM
    raise AttributeError(name)
