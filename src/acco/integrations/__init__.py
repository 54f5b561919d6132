"""Integrations with training frameworks (optional: each imports its framework lazily).

* :mod:`acco.integrations.hf`: ``AccoTrainer``, a ``transformers.Trainer``.
* :mod:`acco.integrations.accelerate`: ``prepare`` for an ``accelerate`` loop.
"""

import importlib as _importlib

__all__ = ["accelerate", "hf"]


def __getattr__(name: str):
    """``acco.integrations.hf`` / ``.accelerate`` on first use (each imports its framework then)."""
    if name in __all__:
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'acco.integrations' has no attribute {name!r}")
