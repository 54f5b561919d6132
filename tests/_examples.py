"""Import an example's script by path, in process, as the tests of examples/nanogpt's study tools do."""

from __future__ import annotations

import importlib.util
import os
import sys

# Module names that more than one folder has (examples/gpt/study.py, benchmarks/time_to_target.py): whichever
# another test imported first must not stand in for the script's own sibling.
SHARED_NAMES = ("study", "time_to_target")


def load_example(path: str, name: str):
    """The script at ``path`` as a module called ``name``, its sibling imports resolved in its own folder. Modules
    already imported under a shared name are set aside while it loads and put back after."""
    folder = os.path.dirname(os.path.abspath(path))
    saved = {n: sys.modules.pop(n, None) for n in SHARED_NAMES}
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
        for n, mod in saved.items():
            sys.modules.pop(n, None)
            if mod is not None:
                sys.modules[n] = mod
    return module
