"""An :class:`~acco.AccoOptimizer`'s configuration, checked and resolved once, then frozen.

The keywords of ``AccoOptimizer(...)`` are split once (:func:`split_keywords`): a
policy's field (``policies.py``) or the wrapped optimizer's. Construction checks
every argument first (:func:`check_arguments`, before the param groups are read,
so a bad option is named before anything is built), then resolves what depends
on the model and the group (the dtypes) into one :class:`Options`. Everything downstream (the loops, the rounds, the agreement
between ranks, the state dict's description) reads that object; nothing
re-derives a setting from the raw arguments or compares mode strings of its own.
"""

from __future__ import annotations

import datetime
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _validation as V
from .modes import Mode
from .policies import (POLICIES, DelayPolicy, HandoffPolicy, OuterPolicy, PrecisionPolicy, RobustnessPolicy,
                       check_estimate_within)

__all__ = ["Options", "check_arguments", "keyword_signature", "markdown_table", "markdown_tables", "resolve",
           "split_keywords"]


@dataclass(frozen=True)
class Options:
    """The resolved settings (docs/options.md): the mode, the class, the placement and the five policies
    (``policies.py``). ``AccoOptimizer``'s attributes of each field's name read them (``opt.max_grad_norm`` is
    ``opt.options.robustness.max_grad_norm``)."""

    mode: Mode  # what it implies: mode.estimates, .synchronous, .delayed (modes.py)
    optimizer_class: type
    placement: Optional[str]  # for a class acco does not know: "elementwise" | "whole"
    handoff: HandoffPolicy
    robustness: RobustnessPolicy
    delay: DelayPolicy  # resolved: estimate_extrapolation a float
    precision: PrecisionPolicy  # resolved: every dtype concrete (estimate_dtype a dtype or None)
    outer: OuterPolicy  # the outer round across regions (outer_every None: none)

    @property
    def estimates(self) -> bool:
        """Mode acco: each update has an estimate round (``theta~``) before its commit."""
        return self.mode.estimates

    @property
    def synchronous(self) -> bool:
        """Mode sync: every update runs to completion in ``step()`` (plain ZeRO-1)."""
        return self.mode.synchronous

    @staticmethod
    def names() -> List[str]:
        """Every option's name (the top three, then each policy's fields): ``AccoOptimizer`` reads each as an
        attribute of the same name."""
        return list(_TOP) + [f.name for cls in POLICIES.values() for f in dataclasses.fields(cls)]

    def value(self, name: str) -> Any:
        """The resolved option ``name`` (one of :meth:`names`)."""
        if name in _TOP:
            return getattr(self, name)
        return getattr(getattr(self, _POLICY_OF[name]), name)

    def agreed(self) -> List[Tuple[str, Any]]:
        """(name, value) of every option, as every rank must have it (``agreement.check_same_model``)."""
        return [(name, _plain(self.value(name))) for name in self.names()]

    def check_microbatches(self, m: int) -> None:
        """Refuse ``m`` micro-batches per update (given, learned or loaded) that leave none after the estimate's
        hand-off (``estimate_microbatches``)."""
        if self.delay.estimate_microbatches is not None:
            check_estimate_within(self.delay.estimate_microbatches, m)

    def clip_hint(self) -> str:
        """What to tell a user whose loop changed ``.grad`` (clipped it) before ``step()``."""
        norm = self.robustness.max_grad_norm
        if norm is None:
            return ("To clip the global gradient norm as clip_grad_norm_ does under DDP, pass max_grad_norm=... to "
                    "AccoOptimizer and do not clip .grad yourself (HF Trainer: acco.integrations.hf.AccoTrainer "
                    "maps max_grad_norm for you).")
        return f"This optimizer already clips with max_grad_norm={norm}: do not clip .grad yourself."


_TOP = ("mode", "optimizer_class", "placement")
_POLICY_OF = {f.name: name for name, cls in POLICIES.items() for f in dataclasses.fields(cls)}


def _plain(value: Any) -> Any:
    """A value whose ``repr`` is the same on every rank that has the same option."""
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, Mode):
        return value.value
    if isinstance(value, (torch.dtype, datetime.timedelta)):
        return str(value)
    return value


def split_keywords(policies: Dict[str, Any], keywords: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``AccoOptimizer(...)``'s policies and its other keywords: each keyword named like a policy's field is that
    field (shorthand), the rest are the wrapped optimizer's (``lr=...``). Returns (policy objects by name, the
    optimizer's keyword arguments). Raises when a field is given both ways, or a policy argument is not one."""
    out = {}
    for name, cls in POLICIES.items():
        given = policies.get(name)
        if given is not None and not isinstance(given, cls):
            raise TypeError(f"{name} must be an acco.{cls.__name__} (or None), got {given!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        short = {k: keywords[k] for k in fields if k in keywords}
        if given is not None and short:
            raise TypeError(f"{sorted(short)} given both as keywords and in {name}={given!r}: pass each once")
        out[name] = given if given is not None else cls(**short)
    rest = {k: v for k, v in keywords.items() if k not in _POLICY_OF}
    return out, rest


def check_arguments(*, mode: Any, optimizer_class: Any, placement: Any, assume_elementwise: Any,
                    microbatches_per_update: Any, policies: Dict[str, Any]) -> Options:
    """Check the arguments that need nothing but themselves, in the order a user reads them. The result still
    holds ``estimate_extrapolation="auto"`` and unresolved dtypes: :func:`resolve` fills them. Raises with what
    was received and what to do."""
    placement = V.check_placement_option(placement, assume_elementwise)
    V.check_optimizer_class(optimizer_class)
    mode = Mode.parse(mode)
    handoff = policies["handoff"].checked(mode, microbatches_per_update)
    elastic = handoff.accumulate_while_communicating
    if elastic and policies["precision"].compression == "auto":
        raise ValueError(
            "compression='auto' with accumulate_while_communicating=True: auto compares a round with the compute "
            "of the micro-batches it hides behind, and this loop sets those by the round itself. Choose the format "
            "yourself (compression='int8' or 'int4' on a slow link, None on a fast one; acco-probe predicts both)")
    return Options(mode=mode, optimizer_class=optimizer_class, placement=placement, handoff=handoff,
                   robustness=policies["robustness"].checked(),
                   delay=policies["delay"].checked(mode, microbatches_per_update, elastic),
                   precision=policies["precision"], outer=policies["outer"].checked(elastic))


def resolve(checked: Options, *, param_dtype: torch.dtype, world_size: int, classes: Sequence[type]) -> Options:
    """The frozen, resolved :class:`Options`: ``checked`` (from :func:`check_arguments`) with the dtypes resolved
    against the parameters' dtype and the group's size, and ``estimate_extrapolation="auto"`` against the groups'
    optimizer ``classes``."""
    elastic = checked.handoff.accumulate_while_communicating
    return dataclasses.replace(checked, precision=checked.precision.resolved(param_dtype, checked.mode, world_size),
                               delay=checked.delay.resolved(checked.mode, elastic, classes))


def keyword_signature(front: inspect.Signature) -> inspect.Signature:
    """``front`` (``AccoOptimizer.__init__``'s) with each policy field as a keyword-only parameter before
    ``**optimizer_kwargs``: what ``help()``, IDEs and ``inspect`` users see."""
    params = [p for p in front.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    for cls in POLICIES.values():
        for f in dataclasses.fields(cls):
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                            annotation=f.type))
    params.append(inspect.Parameter("optimizer_kwargs", inspect.Parameter.VAR_KEYWORD))
    return front.replace(parameters=params)


def markdown_table(name: str) -> str:
    """The ``docs/options.md`` table of the policy ``name``, from its fields (``tests/test_docs.py`` holds the
    file to it; ``python -m acco.options`` prints every table)."""
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    rows += [f"| `{f.name}` | {f.metadata['shown']} | {f.metadata['doc']} |" for f in dataclasses.fields(POLICIES[name])]
    return "\n".join(rows)


def markdown_tables() -> str:
    """Every policy's table, each after the marker ``docs/options.md`` puts before it."""
    marker = "<!-- policy {}: made from acco.policies (python -m acco.options) -->\n"
    return "".join(f"{marker.format(name)}{markdown_table(name)}\n\n" for name in POLICIES)


if __name__ == "__main__":  # pragma: no cover - what docs/options.md holds, to paste
    import sys

    sys.stdout.write(markdown_tables())
