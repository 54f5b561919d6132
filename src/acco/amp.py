"""Loss scaling: ``torch.amp.GradScaler`` driving an :class:`~acco.AccoOptimizer` (fp16 autocast).

Under DDP the scaler unscales and checks the *averaged* gradient. Here ``.grad`` is this rank's local sum until
the round reduces it, so the optimizer does the scaler's part itself: it declares
``_step_supports_amp_scaling``, and torch's ``GradScaler.step(opt)`` then hands itself to
``opt.step(grad_scaler=...)`` instead of unscaling ``.grad``. At that step:

* the local sum is checked for inf/NaN and the flag is OR-ed over the ranks (one all-reduce of one element), then
  recorded in the scaler as its ``found_inf``: ``scaler.update()`` backs off or grows on every rank alike, as
  DDP's scaler does on the averaged gradient;
* the round multiplies the reduced gradient by ``1/scale`` (:class:`~acco.rounds.RoundSpec` ``unscale``; exact for
  the default power-of-two scales). ``.grad`` is left as backward wrote it (scaled);
* an update whose gradient is not finite is skipped by the round on every rank (its averaged gradient is not
  finite), as the scaler skips ``optimizer.step()``.

Mode acco's estimate goes out in the middle of an update, before that update's ``scaler.step()``. It unscales by
the scale of the scaler seen at the last ``step()`` (``update()`` has run since, and the scale changes only there),
or, after a load, by the scale the state dict saved. When that is not the scale the update's ``step()`` brings (the
first update of a run, a scaler that was not in use before), the estimate was taken from gradients of another
scale: that update then runs synchronously and the model holds its committed weights afterwards, as after a
restart (``docs/algorithm.md``).

This module is the one place that reads the scaler's private state (``_per_optimizer_states``: the stage and the
found_inf per device that ``update()`` reads, as torch's own ``ShardedGradScaler`` does; ``_get_scale_async()``);
``tests/test_grad_scaler.py`` holds it to DDP + ``GradScaler`` on the installed torch.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

__all__ = ["LossScale", "UNSCALE_REFUSED"]

# torch's GradScaler warns, at every call site of scaler.step(opt), that it will stop handing itself to optimizers
# that take ``grad_scaler=``: a notice about torch's own protocol, which the user cannot act on. If torch drops
# that protocol, step() raises (optimizer.py) rather than use scaled gradients.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)

UNSCALE_REFUSED = (
    "AccoOptimizer.step(): scaler.unscale_(optimizer) was called before scaler.step(optimizer). .grad is this rank's "
    "local, not yet averaged gradient; AccoOptimizer unscales the averaged one in its round, so leave out "
    "scaler.unscale_(optimizer), and clip with AccoOptimizer(..., max_grad_norm=...) (the norm of the averaged, "
    "unscaled gradient, as DDP + unscale_ + clip_grad_norm_)"
)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """1/scale in fp32, computed as ``GradScaler.unscale_`` computes it (through fp64)."""
    return scale.double().reciprocal().float()


class LossScale:
    """The one owner of what the optimizer knows of a ``GradScaler``: the scaler seen at the last ``step()``, a
    loaded state dict's scale, and what the update's estimate was unscaled by (the window, until the commit)."""

    def __init__(self, device: torch.device, optimizer_id: int) -> None:
        self.device = device
        self.optimizer_id = optimizer_id  # the key of the optimizer's entry in a scaler's per-optimizer states
        self._scaler: Optional[weakref.ref] = None  # seen at the last step(); its scale is the next update's
        self.saved: Optional[float] = None  # a loaded state dict's scale, until a scaler is seen
        # What this update's estimate was unscaled by: None (nothing), a scaler, or a loaded scale (a float).
        self._estimate_source: Any = None

    def _live(self) -> Any:
        return self._scaler() if self._scaler is not None else None

    def for_estimate(self) -> Optional[torch.Tensor]:
        """The estimate's 1/scale (None: unscaled), and remember its source for the commit to check."""
        scaler = self._live()
        if scaler is not None:
            self._estimate_source = scaler
            return _inverse(scaler._get_scale_async())
        self._estimate_source = self.saved
        if self.saved is None:
            return None
        return _inverse(torch.tensor(self.saved, dtype=torch.float64, device=self.device))

    def for_commit(self, scaler: Any, accum: torch.Tensor, group: Optional[dist.ProcessGroup],
                   estimate_in_update: bool) -> Tuple[Optional[torch.Tensor], bool]:
        """At ``step()``: the commit's 1/scale (None: no scaler), and whether the update's estimate (if any) was
        unscaled by the same scale. With a scaler, check ``accum`` for inf/NaN, OR the flag over ``group`` and
        record it in the scaler for its ``update()``. Collective on ``group`` when a scaler is given."""
        source, self._estimate_source = self._estimate_source, None
        if scaler is None:
            self._scaler, self.saved = None, None  # no loss scaling any more: later estimates are not unscaled
            return None, not estimate_in_update or source is None
        state = scaler._per_optimizer_states[self.optimizer_id]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(UNSCALE_REFUSED)
        scale = scaler._get_scale_async()
        found = torch.zeros((), dtype=torch.float32, device=accum.device)
        one = torch.ones((), dtype=torch.float32, device=accum.device)
        # inf/NaN anywhere in this rank's sum (GradScaler's own check; a multiplication by one changes nothing)
        torch._amp_foreach_non_finite_check_and_unscale_([accum], found, one)
        if group is not None:
            # Collective on the user's group, from the caller's thread: inf/NaN on any rank (one element).
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        state["found_inf_per_device"] = {scale.device: found.to(scale.device)}
        same = True
        if estimate_in_update:
            if isinstance(source, float):
                same = source == float(scale)  # once after a load (a host read of the scale)
            else:
                same = source is scaler
        self._scaler, self.saved = weakref.ref(scaler), None
        return _inverse(scale), same

    def load(self, scale: Optional[float]) -> None:
        """A loaded state dict's scale (None: it was saved without loss scaling); the scaler seen before is
        forgotten (the next ``step()`` brings the one in use)."""
        self._scaler, self.saved, self._estimate_source = None, scale, None

    def scale_to_save(self) -> Optional[float]:
        """The scale of the next update (after ``scaler.update()``), for the state dict; None without a scaler."""
        scaler = self._live()
        if scaler is not None:
            return float(scaler.get_scale())
        return self.saved

