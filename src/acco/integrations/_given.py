"""A user-built ``AccoOptimizer`` handed to a framework (the Muon + AdamW split, built with ``from_optimizer``).

The framework then no longer builds the optimizer from its own settings, and it no longer clips or counts
micro-batches itself: a setting the optimizer does not share would be dropped without a word. This module
compares the two and names the fix. Pure: it reads the optimizer's settings and the framework's, nothing else.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

from ..modes import Mode

__all__ = ["check_given_optimizer", "refuse_regions"]


def refuse_regions(outer_every: Any, where: str, fix: str) -> None:
    """Refuse ``outer_every`` (set: an outer round across regions) where the framework's checkpoints write one copy
    of the model, rank 0's: the regions hold their own weights between outer rounds, so the others' would be lost
    and a resume would refuse their state. ``fix``: how to go on in that framework."""
    if outer_every:
        raise NotImplementedError(
            f"{where} with outer_every={outer_every}: its checkpoints write one model, rank 0's, and the regions "
            f"hold their own weights between outer rounds (every other region's would be lost). {fix}; or train "
            "across regions with a hand-written loop (acco.checkpoint.save(path, opt, model=model) on every rank) "
            "or torchtitan's --acco.regions (docs/regions.md)")


def check_given_optimizer(opt: Any, where: str, *, mode: str, mode_setting: str, clip: Optional[float],
                          clip_setting: Optional[str], microbatches: Optional[int],
                          microbatches_setting: Optional[str], options: Dict[str, Any], options_setting: str,
                          model_buffers: Iterable[Any] = (), held_buffers: Iterable[Any] = ()) -> None:
    """Raise ``ValueError`` if ``opt`` (an ``AccoOptimizer`` the user built and passed as ``where``) disagrees
    with the framework: its ``mode``; its gradient clipping ``clip`` (``None`` or <= 0: none; ``clip_setting``
    None: not the framework's to say, e.g. Lightning's manual optimisation); its micro-batches per update
    (``microbatches_setting`` None: not the framework's to say); or framework-held optimizer ``options`` that
    would be ignored; or floating-point ``model_buffers`` (BatchNorm statistics) it does not hold in
    ``held_buffers``, which would drift apart across ranks (the framework's own path keeps every buffer equal, as
    DDP does). ``*_setting`` name the framework's settings in the message."""
    problems = []
    if Mode.parse(opt.mode) is not Mode.parse(mode):
        problems.append(f"it has mode={opt.mode!r} but {mode_setting}={mode!r}: build it with mode={mode!r}, or "
                        f"set {mode_setting}={opt.mode!r}")
    wanted = clip if clip is not None and clip > 0 else None
    if clip_setting is not None and opt.max_grad_norm != wanted:
        problems.append(f"it has max_grad_norm={opt.max_grad_norm!r} but {clip_setting}={clip!r}: build it with "
                        f"max_grad_norm={wanted!r} (the framework no longer clips .grad: the optimizer clips the "
                        f"averaged gradient), or set {clip_setting} to match")
    if microbatches_setting is not None:
        if opt.accumulate_while_communicating:
            problems.append(f"it has accumulate_while_communicating=True, which needs a step() after every "
                            f"micro-batch, but the framework calls step() once per update of {microbatches_setting}="
                            f"{microbatches!r} micro-batches: build it with microbatches_per_update={microbatches!r}")
        elif opt.microbatches_per_update not in (None, microbatches):
            problems.append(f"it has microbatches_per_update={opt.microbatches_per_update!r} but "
                            f"{microbatches_setting}={microbatches!r}: build it with "
                            f"microbatches_per_update={microbatches!r}")
    if options:
        problems.append(f"{options_setting} also got {sorted(options)}, which apply only to the AccoOptimizer the "
                        "framework builds: pass them to the one you build")
    held = {id(b) for b in held_buffers}
    drifting = [b for b in model_buffers if b.is_floating_point() and id(b) not in held]
    if drifting:
        problems.append(f"the model has {len(drifting)} floating-point buffer(s) (e.g. BatchNorm statistics) it does "
                        "not keep equal across ranks: build it with buffers=model.buffers()")
    if problems:
        raise ValueError(f"the AccoOptimizer passed as {where} is taken as it is, and disagrees with the "
                         f"framework's settings: {'; '.join(problems)}")
