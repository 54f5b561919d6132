"""Run a training script of this folder with the learning-rate study's instrumentation; the script is unchanged.

    torchrun --nproc_per_node=2 examples/nanogpt/instrument.py [--acco-option=KEY=VALUE ...] [--estimate-gap] \\
        examples/nanogpt/train_acco.py --out_dir=... [the script's --key=value settings]

* ``--acco-option=KEY=VALUE``: an extra ``AccoOptimizer`` keyword argument, an
  int, a torch dtype or ``None``, e.g. ``synchronous_updates=20`` (the study's
  remedy), ``compute_dtype=bfloat16``, ``reduce_dtype=float32`` or
  ``estimate_dtype=None`` (the paper's exact estimate; the default is ``"auto"``);
* ``--estimate-gap``: after every ``step()``, rank 0 logs ``|theta~ - theta|``
  (what the model holds, in mode acco the estimate, against the committed
  update) and ``|theta_{t+1} - theta_t|`` to ``OUT_DIR/estimate_gap.json``.
  It waits for every commit: a diagnostic, not for timing.

Both act through a subclass of ``AccoOptimizer`` put in place of the library's
before the script imports it; a script without ``AccoOptimizer`` (``train_ddp.py``)
runs as it is.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys

import torch

import acco


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in params])


def instrument(options: dict, estimate_gap: bool, out_dir: str) -> None:
    base = acco.AccoOptimizer
    rows: list = []

    class Instrumented(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, **options})
            self._study_params = [p for g in self.param_groups for p in g["params"]]
            self._study_previous = _flat(self._study_params) if estimate_gap else None

        def step(self, closure=None):
            loss = super().step(closure)
            if estimate_gap and self.rank == 0:
                held = _flat(self._study_params)
                with self.committed_weights():
                    committed = _flat(self._study_params)
                rows.append({"estimate_gap": (held - committed).norm().item(),
                             "update_norm": (committed - self._study_previous).norm().item()})
                self._study_previous = committed
            return loss

    acco.AccoOptimizer = Instrumented
    if estimate_gap and int(os.environ.get("RANK", "0")) == 0:
        atexit.register(lambda: open(os.path.join(out_dir, "estimate_gap.json"), "w").write(json.dumps(rows)))


def main(argv: list) -> None:
    options, estimate_gap = {}, False
    while argv and argv[0].startswith("--"):
        flag = argv.pop(0)
        if flag == "--estimate-gap":
            estimate_gap = True
        elif flag.startswith("--acco-option="):
            key, value = flag.split("=", 1)[1].split("=", 1)
            options[key] = (None if value == "None" else getattr(torch, value)
                            if isinstance(getattr(torch, value, None), torch.dtype) else int(value))
        else:
            raise SystemExit(f"instrument.py: unknown flag {flag!r} (see the docstring)")
    if not argv:
        raise SystemExit("instrument.py: name the training script to run")
    script = argv[0]
    out_dir = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--out_dir=")), ".")
    instrument(options, estimate_gap, out_dir)
    sys.argv = argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
