"""The dtypes an optimizer computes, sums and sends in: each checked and resolved against the others, once.

``compute_dtype`` (the model's parameters), ``accumulation_dtype`` (the sum over micro-batches and ranks),
``reduce_dtype`` (what travels in the reduce-scatter), ``estimate_dtype`` (mode acco's estimate round): FSDP2's
``MixedPrecisionPolicy`` has the same shape. ``options.resolve`` calls these; every error says what was
received and what to pass instead.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .modes import Mode

__all__ = ["check_accumulation_dtype", "check_dtypes", "check_estimate_dtype", "check_reduce_dtype",
           "resolve_estimate_dtype"]


def resolve_estimate_dtype(estimate_dtype: Any, mode: Mode, compute_dtype: torch.dtype, reduce_dtype: torch.dtype,
                           world_size: int) -> Optional[torch.dtype]:
    """``estimate_dtype``: the dtype the estimate round travels in, or ``None`` (like the commit).

    ``"auto"`` (the default) is ``torch.bfloat16`` where it applies and halves the estimate round's bytes: mode
    acco, an fp32 model whose gradients travel in fp32, more than one rank. Anywhere else it is ``None`` (a bf16
    model's weights already travel in bf16). An explicit dtype is checked."""
    if isinstance(estimate_dtype, str):
        if estimate_dtype != "auto":
            raise ValueError(
                f"estimate_dtype must be 'auto', torch.bfloat16 or None, got {estimate_dtype!r}. 'auto' (the default) "
                "sends an fp32 model's estimate round in bf16; None keeps it exact"
            )
        narrow = mode.estimates and compute_dtype == reduce_dtype == torch.float32 and world_size > 1
        return torch.bfloat16 if narrow else None
    check_estimate_dtype(estimate_dtype, mode, reduce_dtype)
    return estimate_dtype


def check_estimate_dtype(estimate_dtype: Any, mode: Mode, reduce_dtype: torch.dtype) -> None:
    if estimate_dtype is None:
        return
    if not mode.estimates:
        raise ValueError(f"estimate_dtype applies to mode='acco' only (its estimate round), got mode={mode!r}")
    if not (isinstance(estimate_dtype, torch.dtype) and estimate_dtype.is_floating_point) or estimate_dtype == torch.float16:
        raise TypeError(f"estimate_dtype must be 'auto', torch.bfloat16 or None, got {estimate_dtype}")
    if estimate_dtype.itemsize >= reduce_dtype.itemsize:
        raise ValueError(
            f"estimate_dtype={estimate_dtype} is not narrower than the gradients' reduce dtype {reduce_dtype}: it "
            "would save no bytes. It is for a model whose gradients travel in fp32: estimate_dtype=torch.bfloat16"
        )


def check_accumulation_dtype(accumulation_dtype: Optional[torch.dtype], compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients are summed in: given, or fp32 for a bfloat16 compute dtype, else the compute dtype."""
    if accumulation_dtype is None:
        return torch.float32 if compute_dtype == torch.bfloat16 else compute_dtype
    if not (isinstance(accumulation_dtype, torch.dtype) and accumulation_dtype.is_floating_point) or (
        accumulation_dtype == torch.float16
    ):
        raise TypeError(
            f"accumulation_dtype must be torch.float32, torch.bfloat16 or torch.float64, got {accumulation_dtype}"
        )
    if accumulation_dtype.itemsize < compute_dtype.itemsize:
        raise TypeError(
            f"accumulation_dtype={accumulation_dtype} is narrower than the compute dtype {compute_dtype}: gradients "
            "would be summed with less precision than they are computed in. Pass None (the default) or a wider dtype"
        )
    return accumulation_dtype


def check_reduce_dtype(reduce_dtype: Optional[torch.dtype], accumulation_dtype: torch.dtype,
                       compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients travel and are summed over ranks in: given, or the accumulation dtype."""
    if reduce_dtype is None:
        return accumulation_dtype
    if not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point) or reduce_dtype == torch.float16:
        raise TypeError(f"reduce_dtype must be torch.float32, torch.bfloat16 or torch.float64, got {reduce_dtype}")
    if not compute_dtype.itemsize <= reduce_dtype.itemsize <= accumulation_dtype.itemsize:
        raise TypeError(
            f"reduce_dtype={reduce_dtype} with compute dtype {compute_dtype} and accumulation dtype "
            f"{accumulation_dtype}: it must be at least as wide as the compute dtype (the weights come back in the "
            "same buffer) and at most as wide as the accumulation dtype. For the paper's bytes with a bf16 model, "
            "pass reduce_dtype=torch.bfloat16"
        )
    return reduce_dtype


def check_dtypes(param_dtype: torch.dtype, compute_dtype: Optional[torch.dtype]) -> None:
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise TypeError(f"compute_dtype must be a floating dtype such as torch.bfloat16, got {compute_dtype}")
    if torch.float16 in (param_dtype, compute_dtype):
        raise TypeError(
            "float16 parameters/compute_dtype are not supported (torch's GradScaler refuses fp16 gradients too). "
            "For fp16, keep the parameters fp32 and train under torch.autocast(dtype=torch.float16) with "
            "torch.amp.GradScaler (loss scaling: AccoOptimizer unscales the averaged gradient); or use "
            "compute_dtype=torch.bfloat16 (same memory, fp32's range, no loss scaling)"
        )
