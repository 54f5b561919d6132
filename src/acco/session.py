"""Session: an optimizer's standing with its ranks and its life, in one owner.

It owns what the loops, the state code and the optimizer's public calls all
need to ask, so that none of them calls back into the optimizer:

* the agreement exchange of the public collective calls (:meth:`gather_row`):
  which call every rank is in, refusals, round counts;
* the group a checkpoint's collectives use (:meth:`collective_group`);
* whether training may go on (:meth:`check_open`): not finished, not inside
  ``committed_weights()``, no failed round;
* the committed-weights view (``in_view``, ``view_swapped``), which a
  checkpoint taken inside the block must know about.

The optimizer holds it, and hands it by reference to its loop and to its
state's owners. It holds no reference to the optimizer, so a dropped optimizer
is freed at once, without waiting for the garbage collector.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist

from . import agreement

__all__ = ["Session"]


class Session:
    """The agreement exchange, the lifecycle flags and the committed-weights view of one optimizer."""

    def __init__(self, group: Optional[dist.ProcessGroup], control_group: Optional[dist.ProcessGroup],
                 control_device: torch.device, driver: Any) -> None:
        self.group = group  # the user's group (None: one process)
        # The agreement gathers of the public collective calls run on the main thread, on this group: the user's,
        # or with ``timeout`` a small gloo group that honours it.
        self.control_group, self.control_device = control_group, control_device
        self.driver = driver
        self.finished = False  # finish() has ended training with this optimizer
        self.in_view = False  # inside committed_weights()
        self.view_swapped = False  # ... and the round buffer holds the model's own weights meanwhile

    def gather_row(self, row: List[int], call: str) -> List[List[int]]:
        """Every rank's ``row`` of ints, in rank order, as part of public call ``call``. Collective: first on the
        rounds' group (a rank still in a round meets the call there: ``RoundDriver.agree_on_rounds``), then on
        the control group; without a group, this process's row alone."""
        if self.group is None:
            return [list(row)]
        if call in agreement.CALLS_AFTER_ROUNDS:
            self.driver.agree_on_rounds(agreement.COLLECTIVE_CALLS.index(call))
        return agreement.all_gather_row(self.control_group, row, self.control_device, call)

    def collective_group(self) -> Optional[dist.ProcessGroup]:
        """The group a checkpoint's collectives use: the rounds' own (idle at an update boundary), else the
        user's."""
        return self.driver.ctx.group if self.driver.ctx.group is not None else self.group

    def check_open(self) -> None:
        """Raise unless training may go on: a failed round, ``finish()`` done, or inside ``committed_weights()``."""
        self.driver.check_not_failed()
        if self.finished:
            raise RuntimeError(
                "AccoOptimizer.step() after finish(): finish() ends training with this optimizer; "
                "build a new AccoOptimizer to train further"
            )
        if self.in_view:
            raise RuntimeError(
                "AccoOptimizer: training inside opt.committed_weights(): the block is for evaluating or saving "
                "the committed weights; call backward()/step() after it"
            )
