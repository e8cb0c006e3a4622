"""Model execution backends.

``reference`` runs any Hugging Face causal LM eagerly (CPU or GPU), batched over particles.
``engine`` is the GPU engine (native Llama, paged KV cache, CUDA graphs, Triton); it is imported
lazily so that the core imports without a GPU or Triton.
"""

import importlib

BACKENDS = {
    "reference": "smcdecode.backends.reference",
    "engine": "smcdecode.backends.engine",
}


def get_backend(name: str):
    """The backend module registered under ``name``."""
    if name not in BACKENDS:
        from ..errors import SMCDecodeError

        raise SMCDecodeError(f"unknown backend {name!r}: choose one of {sorted(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])
