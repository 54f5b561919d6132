"""Where backward writes: ``.grad`` of every trainable parameter bound to a flat buffer.

One owner for the binding between the user's parameters and the library's
gradient buffer. Autograd accumulates each micro-batch straight into the
buffer's per-parameter views (``p.grad`` *is* the view), so several
``backward()`` calls before ``step()`` add up in place, as with any torch
optimizer, and no extra gradient copy exists.

What the user's code (or a framework) may do to ``.grad`` and the parameters,
and what this module does about it:

* ``p.grad = None`` (``zero_grad(set_to_none=True)``), or a fresh ``.grad``
  tensor: the next backward's gradient is copied into the view and ``p.grad``
  re-bound to it (torch's semantics: ``None`` means "discarded").
* ``model.to(...)`` on the same device and dtype (``cpu`` -> ``cpu:0``, as
  Trainer and accelerate do) moves the storage of ``p`` and ``p.grad``: detected
  by address, the gradient is copied back into the buffer and re-bound.
* a parameter moved to another device or cast to another dtype: an error that
  says to build the optimizer after moving the model.
* an in-place change of ``.grad`` between the last ``backward()`` and
  ``step()`` (``clip_grad_norm_``, ``p.grad.mul_``): detected through the
  buffer's version counter, which every view shares; :meth:`check_untouched`
  raises and points to ``max_grad_norm``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .errors import ModelMovedError

__all__ = ["GradBinding", "ModelMovedError"]


class GradBinding:
    """Binds ``p.grad`` of ``params`` to views of ``buffer`` and keeps them bound."""

    def __init__(self, params: Sequence[torch.Tensor], views: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        self.params = list(params)
        self.views = list(views)
        self.buffer = buffer
        self._ptrs = [v.data_ptr() for v in self.views]
        self._version = buffer._version  # the buffer's version at the end of the last backward
        with torch.no_grad():
            for p, v in zip(self.params, self.views):
                if p.grad is not None:
                    v.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
                p.grad = v

    def check_placement(self, i: int) -> None:
        """Raise :class:`ModelMovedError` if parameter ``i`` left the buffer's device or dtype."""
        p, b = self.params[i], self.buffer
        if p.device != b.device or p.dtype != b.dtype:
            raise ModelMovedError(
                f"AccoOptimizer: parameter {i} {tuple(p.shape)} is now {p.dtype} on {p.device}, but the optimizer "
                f"was built for {b.dtype} on {b.device}. Move or cast the model (model.to(...), .cuda(), "
                ".bfloat16()) before building AccoOptimizer, or pass compute_dtype=... to it; "
                "acco.integrations.hf.AccoTrainer builds the optimizer after Trainer has placed the model."
            )

    @torch.no_grad()
    def after_accumulate(self, i: int) -> None:
        """Post-accumulate-grad hook body for parameter ``i``: keep ``p.grad`` in the buffer."""
        p = self.params[i]
        g = p.grad
        if g is not None and not g.is_sparse and g.data_ptr() == self._ptrs[i]:
            return
        self.check_placement(i)
        view = self._rebind(i)
        if g is not None:  # a fresh tensor (after set_to_none), or the view moved by model.to(): its value is .grad's
            view.copy_(g.to_dense() if g.is_sparse else g)

    def _rebind(self, i: int) -> torch.Tensor:
        """A fresh view object as ``p.grad``: model.to() may have swapped the storage under the old one
        (``grad.data = ...``), so the old object cannot be trusted."""
        start = (self._ptrs[i] - self.buffer.data_ptr()) // self.buffer.element_size()
        view = self.buffer[start : start + self.views[i].numel()].view(self.views[i].shape)
        self.views[i] = view
        self.params[i].grad = view
        return view

    def discarded(self, i: int) -> bool:
        """Whether the user discarded ``p.grad`` of parameter ``i`` (set it to ``None`` or another tensor) since
        the library bound it; ``.grad`` moved with the model (``model.to()``: the same view object, new memory)
        is not discarded."""
        g = self.params[i].grad
        return g is None or (g is not self.views[i] and not self.holds(i))

    def holds(self, i: int) -> bool:
        """Whether ``p.grad`` of parameter ``i`` is still the buffer's view (not None, not another tensor)."""
        g = self.params[i].grad
        return g is not None and not g.is_sparse and g.data_ptr() == self._ptrs[i]

    @property
    def version(self) -> int:
        """The buffer's version when the library last saw ``.grad`` as backward or ``zero_grad()`` left it."""
        return self._version

    def mark_backward_end(self) -> None:
        self._version = self.buffer._version

    def check_untouched(self, fix: Callable[[], str], strict: bool = True,
                        on_discard: Optional[Callable[[int], Any]] = None) -> None:
        """Raise if ``.grad`` changed since the last backward (other than through autograd), else re-bind
        any ``p.grad`` the user set to ``None`` (its gradient counts as zero, as torch's optimizers skip it;
        ``on_discard(i)`` is told, for a sum kept elsewhere)."""
        if strict and self.buffer._version != self._version:
            raise RuntimeError(
                "AccoOptimizer.step(): p.grad was modified in place between backward() and step() (e.g. by "
                "torch.nn.utils.clip_grad_norm_, an accelerator's clip_grad_norm_, or a GradScaler's unscale_). "
                "Here .grad is this rank's local, not yet averaged gradient, so such a change would not act on the "
                f"gradient the update uses. {fix()}"
            )
        with torch.no_grad():
            for i, p in enumerate(self.params):
                g = p.grad
                if g is None:
                    self.views[i].zero_()
                    self._rebind(i)
                    if on_discard is not None:
                        on_discard(i)
                elif g.data_ptr() != self._ptrs[i] and g is self.views[i]:  # model.to() after backward
                    self.after_accumulate(i)  # the same re-binding a backward does
                elif g.data_ptr() != self._ptrs[i]:
                    raise RuntimeError(
                        f"AccoOptimizer.step(): p.grad of parameter {i} {tuple(p.shape)} was replaced by another "
                        "tensor between backward() and step(); the optimizer reads gradients from the buffer that "
                        "backward() writes. Leave .grad as backward() left it (clip with max_grad_norm=...)."
                    )
        self._version = self.buffer._version

    @torch.no_grad()
    def zero_(self) -> None:
        """Zero the buffer and make sure every ``p.grad`` is its view (``opt.zero_grad()``)."""
        self.buffer.zero_()
        for i, p in enumerate(self.params):
            if p.grad is not self.views[i] or p.grad.data_ptr() != self._ptrs[i]:
                self._rebind(i)
        self._version = self.buffer._version
