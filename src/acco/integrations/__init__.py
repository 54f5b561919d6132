"""Integrations with training frameworks (optional: each imports its framework lazily).

* :mod:`acco.integrations.hf`: ``AccoTrainer``, a ``transformers.Trainer``.
* :mod:`acco.integrations.accelerate`: ``prepare`` for an ``accelerate`` loop.
"""
