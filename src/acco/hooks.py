"""The optimizer's reactions to autograd and to interpreter exit, held through weak references.

Parameters keep their hooks for as long as they live; the hooks hold the
optimizer's reactions (bound methods) only weakly, so a dropped optimizer (and
its process group) is not kept alive in a cycle that only the collector breaks
at exit. An optimizer never ``finish()``-ed is closed when it is dropped or at
interpreter exit, whichever comes first (:func:`close_unfinished`). This module
is handed callables; it reads nothing of the optimizer.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .collectives import destroy_spare_round_groups

__all__ = ["close_unfinished", "install", "refuse_reentrant_backward"]

_UNFINISHED: Dict[int, "weakref.finalize"] = {}  # the closer of each optimizer not finished yet


def close_unfinished(owner: Any, closer: Callable[[], None]) -> "weakref.finalize":
    """Run ``closer()`` once, when ``owner`` is dropped or at interpreter exit, whichever comes first.

    ``closer`` must not reference ``owner`` (it would never be dropped). Why both moments: a script whose
    ``main()`` returns drops its optimizer *before* exit, and a round left running then, or a round group
    destroyed during interpreter finalisation, aborts the process ("terminate called without an active
    exception"). Returns the handle: ``detach()`` it once the owner closed itself (``finish()``).
    """
    key = id(owner)
    handle = weakref.finalize(owner, _close, key, closer)
    handle.atexit = False  # run by this module's exit hook below, not by weakref's (registered who knows when)
    _UNFINISHED[key] = handle
    return handle


def _close(key: int, closer: Callable[[], None]) -> None:
    _UNFINISHED.pop(key, None)
    closer()


def install(params: Sequence[torch.Tensor], accumulated: Callable[[int], None],
            incoming: Optional[Callable[[int, torch.Tensor], None]]) -> List[Any]:
    """Register hooks on ``params`` (bound methods, held weakly): after autograd accumulated parameter ``i``'s
    gradient, ``accumulated(i)``; with ``incoming`` (an accumulation dtype other than the compute dtype), before
    it does, ``incoming(i, gradient)``. Returns their handles."""
    after = weakref.WeakMethod(accumulated)
    handles = [p.register_post_accumulate_grad_hook(partial(_after_accumulate, after, i)) for i, p in enumerate(params)]
    if incoming is not None:  # each backward's gradient is summed in accumulation_dtype as it arrives
        before = weakref.WeakMethod(incoming)
        for i, p in enumerate(params):
            # The parameter's gradient accumulator (kept alive by the handle, as DDP keeps it): its pre-hook sees
            # exactly what autograd adds into .grad, and not torch.autograd.grad's results.
            with torch.enable_grad():  # the optimizer may be built under no_grad()
                accumulator = p.view_as(p).grad_fn.next_functions[0][0]
            handles.append(_Held(accumulator.register_prehook(partial(_before_accumulate, before, i)), accumulator))
    return handles


class _Held:
    """A hook handle that also keeps the node it is registered on alive."""

    def __init__(self, handle: Any, node: Any) -> None:
        self.handle, self.node = handle, node

    def remove(self) -> None:
        self.handle.remove()
        self.node = None


def _after_accumulate(method: "weakref.WeakMethod", index: int, _param: torch.Tensor) -> None:
    react = method()
    if react is not None:
        react(index)


def _before_accumulate(method: "weakref.WeakMethod", index: int, grads: Any) -> None:
    """Pre-hook of parameter ``index``'s gradient accumulator with ``accumulation_dtype`` != compute dtype: this
    backward's gradient (all its uses summed), before autograd adds it into ``p.grad``, goes into the sum."""
    react = method()
    if react is not None and grads[0] is not None:
        react(index, grads[0])
    return None


@atexit.register
def _close_all_at_exit() -> None:
    for handle in list(_UNFINISHED.values()):
        handle()  # runs the closer unless it already ran or was detached
    destroy_spare_round_groups()  # the round groups finished optimizers left for reuse


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
