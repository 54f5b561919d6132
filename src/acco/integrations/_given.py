"""A user-built ``AccoOptimizer`` handed to a framework (the Muon + AdamW split, built with ``from_optimizer``).

The framework then no longer builds the optimizer from its own settings, and it no longer clips or counts
micro-batches itself: a setting the optimizer does not share would be dropped without a word. This module
compares the two and names the fix. Pure: it reads the optimizer's settings and the framework's, nothing else.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["check_given_optimizer"]


def check_given_optimizer(opt: object, where: str, *, mode: str, mode_setting: str, clip: Optional[float],
                          clip_setting: str, microbatches: Optional[int], microbatches_setting: str) -> None:
    """Raise ``ValueError`` if ``opt`` (an ``AccoOptimizer`` the user built and passed as ``where``) disagrees
    with the framework's ``mode``, gradient clipping ``clip`` (``None``/0: none) or micro-batches per update
    ``microbatches`` (``None``: not the framework's to say). ``*_setting`` name the framework's settings."""
    problems = []
    if opt.mode != mode:
        problems.append((f"mode={opt.mode!r}", f"{mode_setting}={mode!r}",
                         f"build it with mode={mode!r}, or set {mode_setting}={opt.mode!r}"))
    wanted = clip if clip else None
    if opt.max_grad_norm != wanted:
        problems.append((f"max_grad_norm={opt.max_grad_norm!r}", f"{clip_setting}={clip!r}",
                         f"build it with max_grad_norm={wanted!r} (the framework no longer clips .grad: the "
                         f"optimizer clips the averaged gradient), or set {clip_setting} to match"))
    if microbatches is not None and opt.microbatches_per_update not in (None, microbatches):
        problems.append((f"microbatches_per_update={opt.microbatches_per_update!r}",
                         f"{microbatches_setting}={microbatches!r}",
                         f"build it with microbatches_per_update={microbatches!r}"))
    if problems:
        lines = "; ".join(f"it has {have} but {setting}: {fix}" for have, setting, fix in problems)
        raise ValueError(f"the AccoOptimizer passed as {where} is taken as it is, and disagrees with the "
                         f"framework's settings: {lines}")
