"""The three modes, and what each implies: the one place a mode is told apart (``docs/algorithm.md``).

A :class:`Mode` is a ``str`` (``Mode.ACCO == "acco"``, printed as ``acco``), so a user's ``opt.mode == "acco"``
and a state dict's description keep working; the library asks it what it implies instead of comparing names.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["Mode", "MODES"]


class Mode(str, enum.Enum):
    ACCO = "acco"  # estimate round (theta~) from the first half, then the commit: the paper's default
    DPU = "dpu"  # delayed, uncompensated: each commit steps with the previous update's gradient
    SYNC = "sync"  # plain ZeRO-1: every update completes in step()

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    @property
    def estimates(self) -> bool:
        """Each update has an estimate round (theta~) before its commit."""
        return self is Mode.ACCO

    @property
    def synchronous(self) -> bool:
        """Every update runs to completion in ``step()``."""
        return self is Mode.SYNC

    @property
    def delayed(self) -> bool:
        """Each commit steps with the previous update's gradient, uncompensated (the error feedback's place)."""
        return self is Mode.DPU

    @classmethod
    def parse(cls, value: Any) -> "Mode":
        """The mode named ``value`` (a :class:`Mode` or its name); raises naming the choices."""
        try:
            return cls(value)
        except (ValueError, TypeError):
            raise ValueError(f"mode must be one of {MODES}, got {value!r}") from None


MODES = tuple(m.value for m in Mode)
