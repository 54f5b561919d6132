"""The wrapped optimizers: on each rank, one torch optimizer per class, over that rank's share of the master.

An :class:`~acco.AccoOptimizer` wraps one ``optimizer_class``, or one per
param group (``{"params": ..., "optimizer_class": torch.optim.Muon}``: the
Muon + AdamW split). On rank ``r``, each class gets a :class:`Part`: a real
instance of that class whose parameters are views of ``r``'s master slice (and
whose ``.grad`` are views of the gradient slice), with one param group per
``AccoOptimizer`` group of that class, holding:

* the piece of every sliced parameter that meets chunk ``r`` (1-D), and
* the whole tensors ``r`` owns, in their own shape (Muon scales its step by
  the matrix's shape, Adafactor factors over the last two dimensions).

State is found by parameter index (:meth:`WrappedOptimizers.state_of`), never
by position in a wrapped optimizer: a group whose parameters all miss the
chunk is an empty group.

The classes acco knows are placed by what their step needs; another class is
placed as its user says (``placement=``). No collective here.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .placement import SLICE, WHOLE, Layout, newton_schulz_flops

__all__ = ["ELEMENTWISE", "Part", "REFUSED", "WHOLE_TENSOR", "WrappedOptimizers", "class_name", "local_step",
           "placement_of", "placement_cost"]

# torch.optim classes whose step acts on every element on its own (given per-tensor scalars such as AdamW's
# step): a slice of a parameter steps exactly as that slice of the whole parameter would.
ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
)
# torch.optim classes whose step needs the whole tensor: placed whole, on one owner.
WHOLE_TENSOR = tuple(getattr(torch.optim, name) for name in ("Muon", "Adafactor") if hasattr(torch.optim, name))
# torch.optim classes that cannot work under acco at all, and why.
REFUSED = {
    name: why for name, why in (
        ("LBFGS", "it needs a closure that re-evaluates the loss of the whole model inside step(), and its line "
                  "search reads the global loss; acco's step() hands gradients to a round that runs later"),
        ("SparseAdam", "it needs sparse gradients, and acco sums every gradient into a dense buffer"),
    ) if hasattr(torch.optim, name)
}


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def placement_of(cls: type, placement: Optional[str]) -> str:
    """SLICE or WHOLE for ``cls``: known classes by what their step needs, others by ``placement``
    (``"elementwise"`` or ``"whole"``). Raises for a class that cannot work, or an unknown one without it."""
    if cls.__name__ in REFUSED and getattr(torch.optim, cls.__name__, None) is cls:
        raise ValueError(f"optimizer_class {class_name(cls)} cannot be wrapped by AccoOptimizer: {REFUSED[cls.__name__]}.")
    if cls in ELEMENTWISE:
        return SLICE
    if cls in WHOLE_TENSOR:
        return WHOLE
    if placement == "elementwise":
        return SLICE
    if placement == "whole":
        return WHOLE
    raise ValueError(
        f"optimizer_class {class_name(cls)} is not one acco knows, so it cannot tell how its step may be sharded. "
        "Two ways forward: if it treats every element on its own (as AdamW, SGD do: a slice of a parameter steps "
        "as that slice of the whole would), pass placement='elementwise' (each rank steps a 1/N slice of the "
        "flattened parameters); if its step needs whole tensors (as Muon's orthogonalisation or Adafactor's "
        "factored moments do), pass placement='whole' (each tensor is stepped whole, in its own shape, by one "
        f"rank). Known element-wise: {', '.join(c.__name__ for c in ELEMENTWISE)}; known whole-tensor: "
        f"{', '.join(c.__name__ for c in WHOLE_TENSOR)}."
    )


def placement_cost(cls: type, shape: Sequence[int], group: Dict[str, Any]) -> float:
    """What balancing whole tensors weighs: Muon's Newton-Schulz FLOPs, else elements."""
    if getattr(torch.optim, "Muon", None) is cls and len(shape) == 2:
        return newton_schulz_flops(shape, int(group.get("ns_steps", 5)))
    n = 1
    for d in shape:
        n *= int(d)
    return float(n)


def local_step(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer.step()`` with its own step hooks but not torch's global ones
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``/``_post_hook``): those fire once per update, for
    the :class:`~acco.AccoOptimizer` the user steps, on the caller's thread, as for a plain optimizer; a wrapped
    optimizer's step is part of that update, run by the round (on its thread on CPU)."""
    inner = getattr(type(optimizer).step, "__wrapped__", None)
    if not getattr(type(optimizer).step, "hooked", False) or inner is None:  # torch did not wrap it: no hooks
        return optimizer.step()
    args: tuple = (optimizer,)
    kwargs: Dict[str, Any] = {}
    for pre_hook in list(optimizer._optimizer_step_pre_hooks.values()):  # as torch's wrapper, minus the globals
        result = pre_hook(optimizer, args, kwargs)
        if result is not None:
            args, kwargs = result
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        out = inner(*args, **kwargs)
    optimizer._optimizer_step_code()
    for post_hook in list(optimizer._optimizer_step_post_hooks.values()):
        post_hook(optimizer, args, kwargs)
    return out


def class_defaults(cls: type) -> Dict[str, Any]:
    """The hyper-parameters ``cls``'s constructor takes, with their defaults (``lr``, ``betas``, ...)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover - a C extension's constructor
        return {}
    return {k: p.default for k, p in params.items()
            if k not in ("self", "params") and p.default is not inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


@dataclass
class Part:
    """One class's optimizer on this rank, and which parameters it steps."""

    optimizer: torch.optim.Optimizer
    indices: List[int]  # the parameters it steps (global indices), in parameter order
    tensors: List[torch.Tensor]  # their tensors on this rank (views of the master slice), in the same order
    groups: List[int]  # the AccoOptimizer param group of each of its param groups
    pieces: List[Tuple[int, int]] = field(default_factory=list)  # (local start, local end) of each tensor
    # Some tensor skipped a step (no gradient), so a group's tensors may hold different step counts
    counts_differ: bool = False


class WrappedOptimizers:
    """The :class:`Part` of every class on this rank (built once, at construction).

    ``param_groups`` are the ``AccoOptimizer``'s groups (``"params"`` and an optional ``"optimizer_class"``),
    ``classes`` their classes, ``kwargs`` per class the constructor's keyword arguments.
    """

    def __init__(self, layout: Layout, rank: int, master: torch.Tensor, grad: torch.Tensor,
                 param_groups: Sequence[Dict[str, Any]], classes: Sequence[type], kwargs: Dict[type, Dict[str, Any]],
                 index_of_group: Sequence[Sequence[int]]) -> None:
        self.layout, self.rank = layout, rank
        self.n_params = len(layout.params)
        pieces = layout.pieces(rank)
        held = set(layout.stepped_by(rank))
        self.parts: List[Part] = []
        self._where: Dict[int, Tuple[int, int]] = {}  # parameter -> (part, position in part)
        for cls in dict.fromkeys(classes):  # each class once, in order of first use
            part_groups, local_groups, indices, tensors, spans = [], [], [], [], []
            for gi, (group, gcls) in enumerate(zip(param_groups, classes)):
                if gcls is not cls:
                    continue
                params = []
                for i in index_of_group[gi]:
                    if i not in held:
                        continue
                    pc, pp = pieces[i], layout.params[i]
                    t = master[pc.local_start : pc.local_end]
                    t.grad = grad[pc.local_start : pc.local_end]
                    if pp.whole:  # in its own shape: the wrapped optimizer steps the whole tensor
                        t, g = t.view(pp.shape), t.grad.view(pp.shape)
                        t.grad = g
                    self._where[i] = (len(self.parts), len(indices))
                    indices.append(i)
                    tensors.append(t)
                    spans.append((pc.local_start, pc.local_end))
                    params.append(t)
                part_groups.append(gi)
                local_groups.append({**{k: v for k, v in group.items() if k not in ("params", "optimizer_class")},
                                     "params": params})
            try:  # where this rank steps nothing of the class: an instance over empty groups, as torch allows
                optimizer = cls(local_groups, **kwargs.get(cls, {}))
            except TypeError as exc:
                raise TypeError(f"{cls.__name__} rejected its hyper-parameters {sorted(kwargs.get(cls, {}))}: {exc}") from exc
            self.parts.append(Part(optimizer, indices, tensors, part_groups, spans))

    @classmethod
    def around(cls, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> "WrappedOptimizers":
        """One existing optimizer whose parameters are views of ``master`` (a slice of its own), as the one part:
        for a round run by hand (tests, benchmarks). Its tensors are parameters 0, 1, ... in group order."""
        self = cls.__new__(cls)
        tensors = [t for g in optimizer.param_groups for t in g["params"]]
        size = master.element_size()
        spans = [((t.data_ptr() - master.data_ptr()) // size, (t.data_ptr() - master.data_ptr()) // size + t.numel())
                 for t in tensors]
        self.layout = type("_Chunk", (), {"shard_size": master.numel()})()
        self.rank = 0
        self.parts = [Part(optimizer, list(range(len(tensors))), tensors, list(range(len(optimizer.param_groups))), spans)]
        self._where = {i: (0, i) for i in range(len(tensors))}
        self.n_params = len(tensors)
        return self

    # ------------------------------------------------------------ per parameter

    def tensor(self, index: int) -> Optional[torch.Tensor]:
        """Parameter ``index``'s tensor in its part on this rank (None where this rank does not step it)."""
        where = self._where.get(index)
        return None if where is None else self.parts[where[0]].tensors[where[1]]

    def part_of(self, index: int) -> Optional[Part]:
        where = self._where.get(index)
        return None if where is None else self.parts[where[0]]

    def state_of(self, index: int) -> Dict[str, Any]:
        """The wrapped optimizer's state of parameter ``index``'s tensor on this rank (empty if none)."""
        where = self._where.get(index)
        if where is None:
            return {}
        part = self.parts[where[0]]
        return part.optimizer.state.get(part.tensors[where[1]], {})

    def group_of(self, index: int) -> Dict[str, Any]:
        """The wrapped optimizer's param group that holds parameter ``index``'s tensor on this rank."""
        part = self.part_of(index)
        assert part is not None, f"parameter {index} is not stepped on rank {self.rank}"
        t = self.tensor(index)
        return next(g for g in part.optimizer.param_groups if any(x is t for x in g["params"]))

    def set_state(self, index: int, state: Dict[str, Any]) -> None:
        part = self.part_of(index)
        assert part is not None, f"parameter {index} is not stepped on rank {self.rank}"
        part.optimizer.state[self.tensor(index)] = state

    def held(self) -> Iterator[Tuple[int, torch.Tensor]]:
        """(parameter index, tensor) of everything this rank steps, in parameter order."""
        for i in sorted(self._where):
            yield i, self.tensor(i)

    @contextlib.contextmanager
    def without_grads(self, indices: AbstractSet[int]) -> Iterator[None]:
        """For the block, ``.grad`` is ``None`` on this rank's tensors of parameters ``indices``: torch's
        optimizers (and :mod:`acco.functional`) skip them, so they do not move and their state does not advance,
        as under a plain optimizer for a parameter that got no gradient. Their step counts then differ from their
        group's others (``Part.counts_differ``)."""
        held = [(i, self.tensor(i)) for i in sorted(indices) if i in self._where]
        saved = [(t, t.grad) for _, t in held]
        for i, t in held:
            self.part_of(i).counts_differ = True
            t.grad = None
        try:
            yield
        finally:
            for t, g in saved:
                t.grad = g

    # ------------------------------------------------------------ all parts

    @property
    def single(self) -> Optional[torch.optim.Optimizer]:
        """The wrapped optimizer when there is one class (``AccoOptimizer.local_optimizer``), else None."""
        return self.parts[0].optimizer if len(self.parts) == 1 else None

    def clear_state(self) -> None:
        for part in self.parts:
            part.optimizer.state.clear()

    def write_hyper(self, hyper: Sequence[Dict[str, Any]]) -> None:
        """The AccoOptimizer groups' hyper-parameters (as handed off) into every part's groups."""
        for part in self.parts:
            for local, gi in zip(part.optimizer.param_groups, part.groups):
                local.update({k: v for k, v in hyper[gi].items() if k != "optimizer_class"})

    def defaults_of_group(self, group: int) -> Dict[str, Any]:
        """The hyper-parameters of AccoOptimizer group ``group`` as its class's instance filled them in."""
        for part in self.parts:
            if group in part.groups:
                return {k: v for k, v in part.optimizer.param_groups[part.groups.index(group)].items() if k != "params"}
        return {}  # pragma: no cover - every group has a part

    def state_tensors(self) -> List[torch.Tensor]:
        return [v for part in self.parts for st in part.optimizer.state.values() for v in st.values()
                if torch.is_tensor(v)]

    def state_values(self) -> List[Any]:
        return [v for part in self.parts for st in part.optimizer.state.values() for v in st.values()]

    def complement(self, parts: Sequence[Part]) -> List[Tuple[int, int]]:
        """The ranges of the chunk that ``parts``' tensors do not cover (other parts' tensors and padding), in
        order: what an estimate copies from the master around what ``parts`` computed."""
        taken = sorted(span for part in parts for span in part.pieces if span[1] > span[0])
        out, cursor = [], 0
        for a, b in taken:
            if a > cursor:
                out.append((cursor, a))
            cursor = max(cursor, b)
        if cursor < self.layout.shard_size:
            out.append((cursor, self.layout.shard_size))
        return out
