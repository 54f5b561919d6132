"""DistributedDataParallel and AccoOptimizer: only one of them may communicate gradients.

AccoOptimizer reduce-scatters the gradients itself. A model that is also
wrapped in ``DistributedDataParallel`` (HF Trainer, accelerate and nanoGPT-style
scripts all wrap it) would all-reduce every gradient first: twice the traffic,
for the same average. :func:`disable_gradient_allreduce` switches DDP's
all-reduce off (a comm hook that returns the bucket untouched), keeping what
else DDP does (broadcasting parameters and buffers, ``no_sync``);
:func:`check_not_reducing_twice` makes the optimizer refuse to run under a DDP
wrapper that still all-reduces.
"""

from __future__ import annotations

import gc
import warnings
from typing import Iterable, List

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = ["disable_gradient_allreduce", "check_not_reducing_twice"]


def _no_allreduce(state, bucket):  # no annotations: DDP compares them with the real classes, not strings
    """DDP comm hook (``bucket``: a ``dist.GradBucket``): no communication; the bucket's gradients stay this
    rank's, AccoOptimizer averages them."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def disable_gradient_allreduce(model: torch.nn.Module) -> torch.nn.Module:
    """Switch off the gradient all-reduce of a ``DistributedDataParallel`` model; return it.

    Call it once, after wrapping and before the first backward. A model that
    is not DDP-wrapped is returned unchanged, so the call is safe in code that
    runs with and without DDP.
    """
    ddp = _unwrap_ddp(model)
    if ddp is None:
        return model
    _refuse_bucket_views(ddp)
    if not _allreduce_disabled(ddp):
        ddp.register_comm_hook(state=None, hook=_no_allreduce)
    return model


_BUCKET_VIEW_FIX = (
    "DistributedDataParallel(gradient_as_bucket_view=True) makes p.grad a view of DDP's own bucket, taking it "
    "away from the buffer AccoOptimizer sums gradients in: wrap with gradient_as_bucket_view=False (the default; "
    "DDP then communicates nothing anyway after acco.disable_gradient_allreduce), or do not wrap the model"
)


def _refuse_bucket_views(ddp: DistributedDataParallel) -> None:
    if getattr(ddp, "gradient_as_bucket_view", False):
        raise ValueError(_BUCKET_VIEW_FIX)


def _unwrap_ddp(model: torch.nn.Module):
    while model is not None:
        if isinstance(model, DistributedDataParallel):
            return model
        model = getattr(model, "module", None) if isinstance(getattr(model, "module", None), torch.nn.Module) else None
    return None


def _allreduce_disabled(ddp: DistributedDataParallel) -> bool:
    return any(hook is _no_allreduce for hook, _ in getattr(ddp, "_comm_hooks", []))


def ddp_wrappers_of(params: Iterable[torch.Tensor]) -> List[DistributedDataParallel]:
    """The live DDP instances that reduce any of ``params``."""
    ids = {id(p) for p in params}
    found = []
    with warnings.catch_warnings():  # isinstance() on some lazy module attributes warns of deprecations
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance() on a dead weakref.proxy (torch.compile keeps some) raises
            if issubclass(type(obj), DistributedDataParallel):
                if any(id(p) in ids for p in getattr(obj, "_module_parameters", [])):
                    found.append(obj)
    return found


def check_not_reducing_twice(params: Iterable[torch.Tensor]) -> None:
    """Raise if a DDP wrapper all-reduces these parameters' gradients (AccoOptimizer does). Scans the heap once."""
    for ddp in ddp_wrappers_of(params):
        _refuse_bucket_views(ddp)
        if not _allreduce_disabled(ddp):
            raise RuntimeError(
                "AccoOptimizer: the model is wrapped in DistributedDataParallel, whose all-reduce would communicate "
                "every gradient a second time (AccoOptimizer reduce-scatters them itself). Either do not wrap the "
                "model, or switch DDP's all-reduce off once after wrapping: acco.disable_gradient_allreduce(model). "
                "HF Trainer: use acco.integrations.hf.AccoTrainer; accelerate: see the recipe in docs/integrations.md."
            )
