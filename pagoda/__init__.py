"""pagoda: an LLM inference server."""

import os
import sys

# The OpenMP thread trap (see ../shared/MEASURED.md): with spin-waiting OpenMP threads a decode
# step slows 25-100x as soon as another thread wants a core. Passive waiting must be set before
# torch is first imported to take effect.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagoda.sampling_params import SamplingParams  # noqa: E402

__all__ = ["SamplingParams", "LLM"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so `pagoda --help` stays fast.
    if name == "LLM":
        from pagoda.engine.llm import LLM

        return LLM
    raise AttributeError(name)
