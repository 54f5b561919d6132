"""8-bit blocks with a scale each: what a compressed round sends (pure: tensors in, tensors out).

A chunk of ``n`` elements is cut into blocks of ``block`` elements (the last one may be shorter). Each block
``x`` travels as one byte per element and one fp32 scale (``docs/algorithm.md``, "Compressed rounds"):

* ``int8``: ``s = max|x| / 127``, ``q = clamp(round(x / s), -127, 127)``, back as ``q * s``;
* ``fp8`` (e4m3): ``s = max|x| / 448``, ``q = float8_e4m3fn(x / s)`` (round to nearest even), back as
  ``float(q) * s``.

A block of zeros has ``s = 1`` (it comes back as zeros). A block holding inf or NaN has a non-finite ``s``, so
every element of it comes back non-finite: the owner's sum is non-finite and the round's skip (or raise)
applies on every rank, as without compression.

The bytes of a chunk, end to end: the ``ceil(n / block)`` scales' bytes, then the ``n`` payload bytes, padded
to a multiple of four (:func:`packed_size`), so one ``uint8`` buffer of chunks carries both in one message and
every chunk's scales stay aligned.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

__all__ = ["KINDS", "dequantize", "packed_size", "quantize"]

KINDS = {"int8": 127.0, "fp8": 448.0}  # the largest magnitude a payload byte holds


def packed_size(n: int, block: int) -> int:
    """Bytes of a packed chunk of ``n`` elements: four per block's scale, one per element, padded to four."""
    return 4 * math.ceil(n / block) + 4 * math.ceil(n / 4)


def _blocks(x: torch.Tensor, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` (1-D) as its full blocks ``[k, block]`` and its tail (shorter than ``block``, maybe empty)."""
    full = x.numel() // block * block
    return x[:full].view(-1, block), x[full:]


def _scales(x: torch.Tensor, block: int, top: float) -> torch.Tensor:
    """One fp32 scale per block: ``max|x| / top``, ``1`` for a block of zeros, non-finite for a non-finite one."""
    body, tail = _blocks(x, block)
    peaks = body.abs().amax(dim=1)
    if tail.numel():
        peaks = torch.cat([peaks, tail.abs().amax().reshape(1)])
    peaks = peaks.float()
    return torch.where(peaks == 0, torch.ones_like(peaks), peaks / top)


def _split(packed: torch.Tensor, n: int, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A packed chunk's scales (fp32) and payload bytes."""
    k = math.ceil(n / block)
    return packed[: 4 * k].view(torch.float32), packed[4 * k: 4 * k + n]


def quantize(x: torch.Tensor, kind: str, block: int, out: torch.Tensor) -> None:
    """``x`` (1-D, any float dtype) packed into ``out`` (``uint8``, :func:`packed_size` bytes, 4-byte aligned)."""
    top = KINDS[kind]
    scales, payload = _split(out, x.numel(), block)
    scales.copy_(_scales(x, block, top))
    k_full = x.numel() // block
    for part, s, dst in ((_blocks(x, block)[0], scales[:k_full, None], payload[: k_full * block].view(-1, block)),
                         (_blocks(x, block)[1], scales[k_full:], payload[k_full * block:])):
        if not part.numel():
            continue
        y = part.float() / s
        if kind == "int8":
            dst.view(torch.int8).copy_(y.round_().clamp_(-top, top))
        else:
            dst.view(torch.float8_e4m3fn).copy_(y.clamp_(-top, top))


def dequantize(packed: torch.Tensor, kind: str, block: int, n: int) -> torch.Tensor:
    """The fp32 values a packed chunk of ``n`` elements stands for (a new tensor)."""
    scales, payload = _split(packed, n, block)
    q = (payload.view(torch.int8) if kind == "int8" else payload.view(torch.float8_e4m3fn)).float()
    k_full = n // block
    q[: k_full * block].view(-1, block).mul_(scales[:k_full, None])
    q[k_full * block:].mul_(scales[k_full:])
    return q
