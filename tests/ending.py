"""Run a training script under torchrun and end it at update ``AT`` in one way, to test how a process ends.

usage: python ending.py HOW AT SCRIPT [ARGS...]      (as torchrun's script: torchrun ... ending.py HOW AT ...)

HOW, at the ``AT``-th call of ``AccoOptimizer.step()`` on each rank:
  none           nothing (the script ends as it was written)
  exit           ``sys.exit(3)`` right after the step (a round in flight), inside a function
  raise          an exception from user code right after the step
  raise-between  an exception before the step (micro-batches accumulated, not handed off)
  signal         print ``READY`` and slow the next round down (3 s inside the round, on its thread), so that a
                 signal the test sends now lands in the middle of a round; training goes on meanwhile
"""

import os
import runpy
import sys
import threading
import time

import acco.driver
from acco import AccoOptimizer

HOW, AT, SCRIPT = sys.argv[1], int(sys.argv[2]), sys.argv[3]
_calls = 0
_real_step, _real_round = AccoOptimizer.step, acco.driver.run_round
_slow = threading.Event()


class UserError(Exception):
    """What the user's own code raised."""


def _round(*args, **kwargs):
    if _slow.is_set() and os.environ.get("RANK") == "0":
        # Rank 0's round thread issues this round 8 s late: rank 1's round thread is inside its first
        # collective, waiting for rank 0, when the signal arrives (and longer than an exit joins a worker for)
        time.sleep(8.0)
    return _real_round(*args, **kwargs)


def _step(self, *args, **kwargs):
    global _calls
    _calls += 1
    if _calls == AT and HOW == "raise-between":
        raise UserError(f"rank {os.environ.get('RANK')}: user code failed before step {AT}")
    out = _real_step(self, *args, **kwargs)
    if _calls == AT:
        if HOW == "exit":
            sys.exit(3)
        if HOW == "raise":
            raise UserError(f"rank {os.environ.get('RANK')}: user code failed after step {AT}")
        if HOW == "signal":
            _slow.set()
            sys.stdout.write(f"READY rank {os.environ.get('RANK')}\n")  # one write: not split from its newline
            sys.stdout.flush()
    return out


acco.driver.run_round = _round
AccoOptimizer.step = _step
sys.argv = [SCRIPT, *sys.argv[4:]]
sys.path.insert(0, os.path.dirname(os.path.abspath(SCRIPT)))
runpy.run_path(SCRIPT, run_name="__main__")
