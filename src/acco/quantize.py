"""8- and 4-bit blocks with a scale each: what a compressed round sends (pure: tensors in, tensors out).

A chunk of ``n`` elements is cut into blocks of ``block`` elements (the last one may be shorter). Each block
``x`` travels as its kind's bits per element and one fp32 scale (``docs/algorithm.md``, "Compressed rounds"):

* ``int8``: ``s = max|x| / 127``, ``q = clamp(round(x / s), -127, 127)``, back as ``q * s``;
* ``fp8`` (e4m3): ``s = max|x| / 448``, ``q = float8_e4m3fn(x / s)`` (round to nearest even), back as
  ``float(q) * s``;
* ``int4``: ``s = max|x| / 7``, ``q = clamp(round(x / s), -7, 7)``, back as ``q * s``; two elements a byte
  (the first in the low nibble), each as ``q + 8``.

A block of zeros has ``s = 1`` (it comes back as zeros). A scale is never below ``TINY`` (2^-126, fp32's
smallest normal number): ``max|x| / top`` of a block of denormal values, or of a residual that a block without
gradients shrinks commit after commit, would underflow to 0 and make the block ``0/0``, a NaN that skips every
later update; at ``TINY`` such a block rounds to the nearest multiple of the scale, and the error feedback keeps
what it drops. A block holding inf or NaN has a non-finite ``s``, so every element of it comes back non-finite:
the owner's sum is non-finite and the round's skip (or raise) applies on every rank, as without compression.

The bytes of a chunk, end to end: the ``ceil(n / block)`` scales' bytes, then the payload (``n`` elements of
the kind's ``bits`` each, :func:`payload_bytes`), padded to a multiple of four (:func:`packed_size`), so one
``uint8`` buffer of chunks carries both in one message and every chunk's scales stay aligned.

:data:`KINDS` is the one list of kinds: the policy accepts its names, the transport sizes its buffers from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

__all__ = ["KINDS", "Kind", "dequantize", "dequantize_add_", "packed_size", "payload_bytes", "quantize", "residual_of"]


def _encode_int8(y: torch.Tensor, top: float, dst: torch.Tensor) -> None:
    dst.view(torch.int8).copy_(y.round_().clamp_(-top, top))


def _decode_int8(src: torch.Tensor, n: int) -> torch.Tensor:
    return src.view(torch.int8).float()


def _encode_fp8(y: torch.Tensor, top: float, dst: torch.Tensor) -> None:
    dst.view(torch.float8_e4m3fn).copy_(y.clamp_(-top, top))


def _decode_fp8(src: torch.Tensor, n: int) -> torch.Tensor:
    return src.view(torch.float8_e4m3fn).float()


def _encode_int4(y: torch.Tensor, top: float, dst: torch.Tensor) -> None:
    q = y.round_().clamp_(-top, top).add_(8).to(torch.uint8)  # 1..15: the nibble q + 8
    if q.numel() % 2:  # an odd last slab: its last byte's high nibble is zero
        q = torch.cat([q, q.new_zeros(1)])
    pairs = q.view(-1, 2)
    torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=dst)


def _decode_int4(src: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([src & 0xF, src >> 4], dim=1).view(-1)[:n].float().sub_(8)


@dataclass(frozen=True)
class Kind:
    """One quantized wire format: ``top``, the largest magnitude a payload element holds; ``bits`` per element;
    ``encode(y, top, dst)``: the values ``y`` (fp32, already divided by their scales; it may scratch them) into
    the payload bytes ``dst``; ``decode(src, n)``: ``n`` values back from the payload bytes ``src``, in fp32 (a
    new tensor)."""

    top: float
    bits: int
    encode: Callable[[torch.Tensor, float, torch.Tensor], None]
    decode: Callable[[torch.Tensor, int], torch.Tensor]


KINDS = {"int8": Kind(127.0, 8, _encode_int8, _decode_int8), "fp8": Kind(448.0, 8, _encode_fp8, _decode_fp8),
         "int4": Kind(7.0, 4, _encode_int4, _decode_int4)}
TINY = torch.finfo(torch.float32).tiny  # the smallest scale: 2^-126, so x / s never divides by an underflowed 0


def payload_bytes(n: int, kind: str = "int8") -> int:
    """Bytes of the payload of ``n`` elements of ``kind`` (``bits`` each, the last byte maybe part full)."""
    return math.ceil(n * KINDS[kind].bits / 8)


def packed_size(n: int, block: int, kind: str = "int8") -> int:
    """Bytes of a packed chunk of ``n`` elements of ``kind``: four per block's scale, then the payload, padded to
    four."""
    return 4 * math.ceil(n / block) + 4 * math.ceil(payload_bytes(n, kind) / 4)


SLAB = 1 << 18  # elements the quantizer works through at a time: its fp32 temporaries span at most one slab


def _slabs(n: int, block: int):
    """``(a, b)`` ranges covering ``0..n`` in order, each whole blocks (but the last): at most about ``SLAB``
    elements, so a chunk's temporaries are a slab's, not the chunk's (``φ/N`` elements, 4 bytes each). Every
    slab but the last has an even length, so each begins on a whole byte of a payload of fewer bits."""
    step = max(1, SLAB // block) * block
    step *= 2 if step % 2 else 1
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _blocks(x: torch.Tensor, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` (1-D) as its full blocks ``[k, block]`` and its tail (shorter than ``block``, maybe empty)."""
    full = x.numel() // block * block
    return x[:full].view(-1, block), x[full:]


def _scales(x: torch.Tensor, block: int, top: float) -> torch.Tensor:
    """One fp32 scale per block: ``max|x| / top`` but at least ``TINY``, ``1`` for a block of zeros, non-finite
    for a non-finite one (``clamp`` keeps a NaN)."""
    body, tail = _blocks(x, block)
    peaks = body.abs().amax(dim=1)
    if tail.numel():
        peaks = torch.cat([peaks, tail.abs().amax().reshape(1)])
    peaks = peaks.float()
    return torch.where(peaks == 0, torch.ones_like(peaks), (peaks / top).clamp_(min=TINY))


def _bytes(kind: str, a: int, b: int) -> slice:
    """The payload bytes of elements ``a..b`` (``a`` at the start of a slab: on a whole byte)."""
    return slice(a * KINDS[kind].bits // 8, payload_bytes(b, kind))


def _split(packed: torch.Tensor, n: int, block: int, kind: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """A packed chunk's scales (fp32) and payload bytes."""
    k = math.ceil(n / block)
    return packed[: 4 * k].view(torch.float32), packed[4 * k: 4 * k + payload_bytes(n, kind)]


def quantize(x: torch.Tensor, kind: str, block: int, out: torch.Tensor,
             minus: Optional[torch.Tensor] = None) -> None:
    """``x`` (1-D, any float dtype; with ``minus``, ``x - minus`` in fp32) packed into ``out`` (``uint8``,
    :func:`packed_size` bytes, 4-byte aligned), slab by slab."""
    k = KINDS[kind]
    scales, payload = _split(out, x.numel(), block, kind)
    for a, b in _slabs(x.numel(), block):
        xs = x[a:b] if minus is None else x[a:b].float() - minus[a:b].float()
        s = scales[a // block: -(-b // block)]
        s.copy_(_scales(xs, block, k.top))
        k_full = (b - a) // block
        y = torch.empty(b - a, dtype=torch.float32, device=x.device)  # the slab over its scales, then encoded
        body, tail = _blocks(xs, block)
        torch.div(body.float(), s[:k_full, None], out=y[: k_full * block].view(-1, block))
        if tail.numel():
            torch.div(tail.float(), s[k_full:], out=y[k_full * block:])
        k.encode(y, k.top, payload[_bytes(kind, a, b)])


def _dequantized(scales: torch.Tensor, payload: torch.Tensor, kind: str, block: int, a: int, b: int) -> torch.Tensor:
    """The fp32 values of elements ``a..b`` (whole blocks from ``a``) of a packed chunk: a new slab."""
    q = KINDS[kind].decode(payload[_bytes(kind, a, b)], b - a)
    s = scales[a // block: -(-b // block)]
    k_full = (b - a) // block
    q[: k_full * block].view(-1, block).mul_(s[:k_full, None])
    q[k_full * block:].mul_(s[k_full:])
    return q


def dequantize(packed: torch.Tensor, kind: str, block: int, n: int) -> torch.Tensor:
    """The fp32 values a packed chunk of ``n`` elements stands for (a new tensor)."""
    out = torch.zeros(n, dtype=torch.float32, device=packed.device)
    dequantize_add_(packed, kind, block, n, out)
    return out


def dequantize_add_(packed: torch.Tensor, kind: str, block: int, n: int, out: torch.Tensor) -> None:
    """``out`` (``n`` elements, any float dtype) += the values a packed chunk stands for, added in fp32 and cast
    back to ``out``'s dtype, slab by slab."""
    scales, payload = _split(packed, n, block, kind)
    for a, b in _slabs(n, block):
        o = out[a:b]
        o.copy_(o.float().add_(_dequantized(scales, payload, kind, block, a, b)))


def residual_of(x: torch.Tensor, packed: torch.Tensor, kind: str, block: int, out: torch.Tensor,
                keep: Optional[torch.Tensor] = None) -> None:
    """``out`` = ``x - dequantize(packed)`` in fp32 (cast to ``out``'s dtype), slab by slab: what the
    quantization of ``x`` dropped. ``keep`` (a device flag): where set, ``out`` stays as it was."""
    scales, payload = _split(packed, x.numel(), block, kind)
    for a, b in _slabs(x.numel(), block):
        new = x[a:b].float() - _dequantized(scales, payload, kind, block, a, b)
        if keep is not None:
            new = torch.where(keep, out[a:b].float(), new)
        out[a:b].copy_(new)
