"""The optional extras the tests cover (transformers, accelerate, lightning): ``make test`` and ``make test-all``
install them and set ``ACCO_REQUIRE_EXTRAS=1``, so that there (and in CI) a missing extra fails its tests
instead of skipping them; a bare ``pytest`` without the extras skips, naming what to install."""

from __future__ import annotations

import importlib
import os

import pytest

REQUIRED = os.environ.get("ACCO_REQUIRE_EXTRAS") == "1"


def need(module: str, extra: str) -> None:
    """Import ``module`` for a test file (call at its top): a failure under ``make test``, else a skip."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if REQUIRED:
            raise ImportError(f"{module} is missing, and make test installs it (the extra '{extra}'): "
                              f"pip install -e '.[{extra}]'") from exc
        pytest.skip(f"needs {module} (pip install -e '.[{extra}]')", allow_module_level=True)


def available(module: str, extra: str) -> bool:
    """Whether ``module`` is installed, for a ``skipif``; under ``make test`` a missing one raises instead."""
    try:
        importlib.import_module(module)
        return True
    except ImportError as exc:
        if REQUIRED:
            raise ImportError(f"{module} is missing, and make test installs it (the extra '{extra}')") from exc
        return False
