"""The optimizer's reactions to autograd and to interpreter exit, held through weak references.

Parameters keep their hooks for as long as they live; the hooks hold the
optimizer only weakly, so a dropped optimizer (and its process group) is not
kept alive in a cycle that only the collector breaks at exit. Optimizers that
were never ``finish()``-ed are closed at exit (:data:`LIVE`).
"""

from __future__ import annotations

import atexit
import sys
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any, List, Sequence

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .optimizer import AccoOptimizer

__all__ = ["LIVE", "install", "refuse_reentrant_backward"]

LIVE: "weakref.WeakSet[AccoOptimizer]" = weakref.WeakSet()


def install(opt: "AccoOptimizer", params: Sequence[torch.Tensor], fold_on_arrival: bool) -> List[Any]:
    """Register the optimizer's hooks on ``params``; returns their handles."""
    ref = weakref.ref(opt)
    handles = [p.register_post_accumulate_grad_hook(partial(_after_accumulate, ref, i)) for i, p in enumerate(params)]
    if fold_on_arrival:  # each backward's gradient is summed in accumulation_dtype as it arrives
        for i, p in enumerate(params):
            # The parameter's gradient accumulator (kept alive by the handle, as DDP keeps it): its pre-hook sees
            # exactly what autograd adds into .grad, and not torch.autograd.grad's results.
            with torch.enable_grad():  # the optimizer may be built under no_grad()
                accumulator = p.view_as(p).grad_fn.next_functions[0][0]
            handles.append(_Held(accumulator.register_prehook(partial(_before_accumulate, ref, i)), accumulator))
    return handles


class _Held:
    """A hook handle that also keeps the node it is registered on alive."""

    def __init__(self, handle: Any, node: Any) -> None:
        self.handle, self.node = handle, node

    def remove(self) -> None:
        self.handle.remove()
        self.node = None


def _after_accumulate(ref: "weakref.ref[AccoOptimizer]", index: int, _param: torch.Tensor) -> None:
    opt = ref()
    if opt is not None:
        opt._on_grad_accumulated(index)


def _before_accumulate(ref: "weakref.ref[AccoOptimizer]", index: int, grads: Any) -> None:
    """Pre-hook of parameter ``index``'s gradient accumulator with ``accumulation_dtype`` != compute dtype: this
    backward's gradient (all its uses summed), before autograd adds it into ``p.grad``, goes into the sum."""
    opt = ref()
    if opt is not None and not opt._finished and grads[0] is not None:
        opt._flat.add_incoming(index, grads[0])
    return None


@atexit.register
def _close_all_at_exit() -> None:
    for opt in list(LIVE):
        opt._close_at_exit()


def refuse_reentrant_backward() -> None:
    """Raise if this backward runs inside another one (reentrant activation checkpointing): its end would be
    taken for the end of a micro-batch. Called once per backward pass, so the stack walk costs little."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "backward" and code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py"):
            raise RuntimeError(
                "AccoOptimizer: a backward() inside another (activation checkpointing with use_reentrant=True): "
                "one step() per update counts backward passes as micro-batches. Use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) (HF: "
                "gradient_checkpointing_kwargs={'use_reentrant': False})"
            )
        frame = frame.f_back
