"""``Opt*`` by snapshot: the general way to take an optimizer step and undo it.

For optimizers :mod:`acco.functional` does not compute (anything but Adam,
AdamW, SGD), an estimate round takes the real step on the master slice and
the state, all-gathers, then puts both back from this snapshot. On the CUDA
path the same snapshot undoes a step whose gradient was not finite, on the
device (:meth:`OptimizerSnapshot.restore_where`), so the host never decides.
No collective.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["OptimizerSnapshot"]


def skips_in_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the wrapped optimizer's own kernel can skip a whole step on the device: fused Adam and AdamW
    read ``optimizer.found_inf`` (as ``torch.amp.GradScaler`` sets it) and, where it is non-zero, leave the
    parameters, the state and the step count as they were. Such a step needs no snapshot to be undone."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and all(
        g.get("fused") and not g.get("differentiable") for g in optimizer.param_groups)


def _pairs(parts: Sequence[Any]) -> List[Tuple[torch.optim.Optimizer, torch.Tensor]]:
    """(optimizer, tensor) of every tensor the wrapped optimizers ``parts`` step, in a fixed order."""
    return [(part.optimizer, t) for part in parts for t in part.tensors]


class OptimizerSnapshot:
    """Scratch copy of the master slice and the optimizer state, for ``Opt*``.

    Buffers are allocated once and reused (``copy_``), so an estimate round costs
    at most one extra master slice and one extra state slice (``12 Phi / N``
    bytes for AdamW), and tensors keep their addresses across rounds. ``parts``
    are the wrapped optimizers (:class:`~acco.wrapped.Part`) whose step is
    taken: the same list at ``save`` and ``restore``.
    """

    def __init__(self) -> None:
        self.stepped = False  # a step has been applied to the optimizer (set by run_round)
        self._master: Optional[torch.Tensor] = None
        self._state: Dict[int, Dict[str, Any]] = {}
        self._had_state: Dict[int, bool] = {}

    def save(self, parts: Sequence[Any], master: torch.Tensor) -> None:
        if self._master is None:
            self._master = torch.empty_like(master)
        self._master.copy_(master)
        for i, (optimizer, p) in enumerate(_pairs(parts)):
            state = optimizer.state.get(p)
            self._had_state[i] = bool(state)
            if not state:
                continue
            saved = self._state.setdefault(i, {})
            for key in list(saved):
                if key not in state:
                    del saved[key]
            for key, value in state.items():
                if torch.is_tensor(value):
                    old = saved.get(key)
                    if torch.is_tensor(old) and old.shape == value.shape and old.dtype == value.dtype:
                        old.copy_(value)
                    else:
                        saved[key] = value.detach().clone()
                else:
                    saved[key] = copy.deepcopy(value)

    def tensors(self) -> List[torch.Tensor]:
        """The scratch tensors held (for memory accounting)."""
        out = [] if self._master is None else [self._master]
        return out + [v for st in self._state.values() for v in st.values() if torch.is_tensor(v)]

    def restorable_on_device(self, parts: Sequence[Any], master: torch.Tensor) -> bool:
        """Whether :meth:`restore_where` can undo a step without the host: all the state is tensors on the
        master's device, and a tensor without state is one the optimizer keeps none for (``stepped``: a step has
        been applied since, e.g. SGD without momentum). Not so before the first step (it creates state that
        would have to be dropped), or for a step counter on the CPU."""
        for optimizer, p in _pairs(parts):
            state = optimizer.state.get(p)
            if not state:
                if not self.stepped:
                    return False
                continue
            for value in state.values():
                if not torch.is_tensor(value) or value.device != master.device:
                    return False
        return True

    def restore_where(self, undo: torch.Tensor, parts: Sequence[Any], master: torch.Tensor) -> None:
        """Where the device flag ``undo`` is set, put back what :meth:`save` saw; else keep the step. No host sync.

        Needs :meth:`restorable_on_device` to have held at :meth:`save`.
        """
        assert self._master is not None, "restore_where() without save()"
        torch.where(undo, self._master, master, out=master)
        for i, (optimizer, p) in enumerate(_pairs(parts)):
            if not self._had_state[i]:
                continue  # a tensor the optimizer keeps no state for
            state, saved = optimizer.state[p], self._state[i]
            for key, value in saved.items():
                torch.where(undo.to(value.device), value, state[key], out=state[key])

    def extrapolate(self, master: torch.Tensor, ranges: Sequence[Tuple[int, int]], extrapolation: float) -> None:
        """``master[a:b] = saved + c * (master[a:b] - saved)`` over ``ranges`` (one foreach lerp), ``saved`` what
        :meth:`save` saw: a step taken since, extrapolated by ``c`` (``estimate_extrapolation``); where the
        master did not move, it stays exactly as it is (finite values: an infinite weight becomes NaN, but its
        gradient is not finite, and such a round is skipped before this)."""
        assert self._master is not None, "extrapolate() without save()"
        ranges = [(a, b) for a, b in ranges if b > a]
        if ranges:
            torch._foreach_lerp_([master[a:b] for a, b in ranges], [self._master[a:b] for a, b in ranges],
                                 1.0 - extrapolation)

    def restore(self, parts: Sequence[Any], master: torch.Tensor) -> None:
        assert self._master is not None, "restore() without save()"
        master.copy_(self._master)
        for i, (optimizer, p) in enumerate(_pairs(parts)):
            if not self._had_state[i]:
                optimizer.state.pop(p, None)
                continue
            state, saved = optimizer.state[p], self._state[i]
            for key in [k for k in state if k not in saved]:
                del state[key]
            for key, value in saved.items():
                cur = state.get(key)
                if torch.is_tensor(value) and torch.is_tensor(cur) and cur.shape == value.shape and cur.dtype == value.dtype:
                    cur.copy_(value)
                else:
                    state[key] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
