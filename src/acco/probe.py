"""Will ACCO pay off on this cluster? Measure a round, predict the speedup.

Run it where you train, with your model's size, one process per GPU::

    torchrun --nnodes 4 --nproc-per-node 8 ... -m acco.probe --params 350M --compute-seconds 0.42

It times real rounds of :class:`~acco.AccoOptimizer` (reduce-scatter ->
sharded AdamW step -> all-gather) on a ``--params``-element model in
``--dtype``, and takes the compute time of half a mini-batch on one rank from
``--compute-seconds`` (the forward+backward of one micro-batch, timed in your
own loop: best), or else estimates it from this device's matmul throughput
and ``--tokens`` (6 FLOPs per parameter and token: optimistic, so the
prediction then favours sync). It prints the predicted update time of sync
ZeRO-1 (``T_compute + T_round``) and of acco (``max(T_compute, 2 T_round)``:
two rounds per update, each hidden behind half the mini-batch), the speedup,
and what to do. ``--json`` prints the numbers instead. Collective: all ranks
run it.

With ``--optimizer muon --matrix 768x3072`` the rounds step ``torch.optim.Muon``
on ``--params / (768*3072)`` matrices of that shape, placed whole (each on one
owner rank, which runs its Newton–Schulz iterations inside the round): give the
shape of your hidden matrices, and count only them in ``--params``.

With ``--compression int8`` (or ``fp8``) it also times rounds with
``compression=`` that format (8-bit blocks both ways, ``docs/compression.md``)
and predicts acco with them, against the same sync ZeRO-1 of full-width rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .quantize import KINDS

__all__ = ["Prediction", "measure_round", "parse_count", "parse_matrix", "predict", "probe_parameters"]

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}


def parse_count(text: str) -> int:
    """``"350M"`` -> 350_000_000; accepts k/M/B suffixes and plain integers."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmbg]?)\s*", str(text).lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"expected a positive count such as 124M, 1.3B or 50000, got {text!r}")
    return int(float(m.group(1)) * _SUFFIX[m.group(2)])


@dataclass
class Prediction:
    """Per-update times (seconds) for one mini-batch of ``2 * microbatches_per_half`` micro-batches per rank."""

    compute_half_s: float  # forward+backward of half a mini-batch, one rank
    round_s: float  # one round
    microbatches_per_half: int
    sync_update_s: float
    acco_update_s: float
    speedup: float  # sync / acco, per update of the same size
    hidden: float  # predicted share of round time hidden behind compute
    recommended_microbatches_per_half: int
    recommendation: str


def predict(compute_s: float, round_s: float, microbatches_per_half: int = 1) -> Prediction:
    """Pure: the update-time model of ``docs/benchmarks.md`` ("Does the overlap pay on my network?").

    ``compute_s`` is one micro-batch's forward+backward; half a mini-batch is
    ``microbatches_per_half`` of them. Sync ZeRO-1 computes the whole mini-batch
    and then runs one round; acco runs two rounds per update, each behind half
    the mini-batch, so it is bound by ``max(T_compute, 2 T_round)``.
    """
    if compute_s <= 0 or round_s < 0 or microbatches_per_half < 1:
        raise ValueError(f"need compute_s > 0, round_s >= 0, microbatches_per_half >= 1; got "
                         f"{compute_s}, {round_s}, {microbatches_per_half}")
    half = compute_s * microbatches_per_half
    sync, acco = 2 * half + round_s, max(2 * half, 2 * round_s)
    hidden = 1.0 if round_s <= half else half / round_s
    k = max(microbatches_per_half, math.ceil(round_s / compute_s - 1e-9))
    if round_s <= 0.05 * 2 * half:
        text = (f"communication is already small (a round is {round_s / (2 * half):.0%} of the mini-batch's "
                "compute): acco and sync ZeRO-1 are within 5% of each other here.")
    elif round_s <= half:
        text = (f"acco hides each round behind half a mini-batch: predicted {sync / acco:.2f}x the updates/s of "
                "sync ZeRO-1 at the same batch size. Use AccoOptimizer(mode='acco').")
    else:
        kp = predict(compute_s, round_s, k)
        text = (f"a round ({round_s * 1e3:.0f} ms) outlasts half a mini-batch ({half * 1e3:.0f} ms): acco gives "
                f"{sync / acco:.2f}x sync at {2 * half / acco:.0%} of the compute's speed; with {k} micro-batches "
                f"per half (microbatches_per_update={2 * k}, i.e. a {k}x larger batch) the round is hidden, acco runs at the "
                f"compute's full speed and gives {kp.speedup:.2f}x sync at that batch size. "
                "With ranks of unequal speed, accumulate_while_communicating=True lets fast ranks keep accumulating.")
    return Prediction(compute_s * microbatches_per_half, round_s, microbatches_per_half, sync, acco, sync / acco,
                      hidden, k, text)


def parse_matrix(text: str) -> Tuple[int, int]:
    """``"768x3072"`` -> ``(768, 3072)``."""
    m = re.fullmatch(r"\s*([0-9]+)\s*[xX*]\s*([0-9]+)\s*", str(text))
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"expected a matrix shape such as 768x3072 (your hidden matrices'), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def matrix_count(numel: int, matrix: Tuple[int, int]) -> int:
    """How many ``matrix``-shaped tensors stand for ``numel`` elements (at least one)."""
    return max(1, round(numel / (matrix[0] * matrix[1])))


def probe_parameters(numel: int, dtype: torch.dtype, device: torch.device,
                     matrix: Optional[Tuple[int, int]] = None) -> List[torch.nn.Parameter]:
    """The model the rounds step: one flat ``numel``-element tensor, or (``matrix``) ``numel / (rows*cols)``
    matrices of that shape (at least one)."""
    if matrix is None:
        return [torch.nn.Parameter(torch.zeros(numel, dtype=dtype, device=device))]
    return [torch.nn.Parameter(torch.zeros(matrix, dtype=dtype, device=device))
            for _ in range(matrix_count(numel, matrix))]


def measure_round(numel: int, dtype: torch.dtype, device: torch.device, rounds: int = 5, warmup: int = 2,
                  optimizer_class: type = torch.optim.AdamW, matrix: Optional[Tuple[int, int]] = None,
                  compression: Optional[str] = None) -> float:
    """Mean seconds of a real sync round on a ``numel``-element model (``matrix``: matrices of that shape)
    stepped by ``optimizer_class``; ``compression``: the rounds in that 8-bit format. Collective: call on all
    ranks."""
    from .optimizer import AccoOptimizer

    params = probe_parameters(numel, dtype, device, matrix)
    opt = AccoOptimizer(params, optimizer_class, mode="sync", accumulate_while_communicating=True,
                        compression=compression, lr=1e-6)  # step() without backward
    # Not all equal: Muon's Newton-Schulz then works on a full-rank matrix, as in training.
    grad = torch.randn(params[0].shape, generator=torch.Generator().manual_seed(0)).to(params[0]) * 1e-3
    for _ in range(warmup + rounds):
        for p in params:
            p.grad.copy_(grad)
        opt.step()  # sync: the round runs to completion
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a CPU-GPU sync point: the rounds' timing events must be complete
    stats = opt.round_stats(last=rounds)
    opt.finish()
    times = [s["round_s"] for s in stats if s["round_s"] is not None]
    return sum(times) / len(times)


def matmul_flops(dtype: torch.dtype, device: torch.device, seconds: float = 1.0) -> float:
    """Sustained matmul FLOP/s of this device in ``dtype`` (square matrices)."""
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    a @ b
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        count += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a CPU-GPU sync point: this is a timing loop
    return 2 * n**3 * count / (time.perf_counter() - t0)


def _compressed(full: Prediction, packed: Prediction) -> dict:
    """acco with compressed rounds (``packed``) against sync ZeRO-1 and acco with full-width ones (``full``)."""
    return {"round_s": packed.round_s, "acco_update_s": packed.acco_update_s, "hidden": packed.hidden,
            "speedup": full.sync_update_s / packed.acco_update_s,
            "vs_acco": full.acco_update_s / packed.acco_update_s}


def _all_max(x: float, device: torch.device) -> float:
    """The largest ``x`` over ranks (the slowest rank sets the pace). Collective."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _parse(argv: Optional[List[str]]):
    p = argparse.ArgumentParser(prog="python -m acco.probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", required=True, type=parse_count, help="model size in elements, e.g. 350M")
    p.add_argument("--compute-seconds", type=float, default=None,
                   help="forward+backward time of one micro-batch on one rank (measure it in your loop)")
    p.add_argument("--tokens", type=parse_count, default=None, help="tokens per micro-batch, to estimate compute")
    p.add_argument("--microbatches-per-half", type=int, default=1,
                   help="micro-batches in each half of an update (microbatches_per_update / 2)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="compute dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                   help="muon: torch.optim.Muon on whole matrices of --matrix's shape")
    p.add_argument("--matrix", default=None, help="with --optimizer muon: your hidden matrices' shape, e.g. 768x3072")
    p.add_argument("--compression", choices=list(KINDS), default=None,
                   help="also time rounds compressed to this format and predict acco with them")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.compute_seconds is None and args.tokens is None:
        p.error("give --compute-seconds (best: timed in your training loop) or --tokens (an estimate)")
    if args.compute_seconds is not None and args.compute_seconds <= 0:
        p.error(f"--compute-seconds must be positive, got {args.compute_seconds}")
    if args.microbatches_per_half < 1 or args.rounds < 1:
        p.error("--microbatches-per-half and --rounds must be at least 1")
    if args.optimizer == "muon" and args.matrix is None:
        p.error("--optimizer muon needs --matrix: the shape of your hidden matrices (e.g. 768x3072); count only "
                "them in --params")
    if args.optimizer != "muon" and args.matrix is not None:
        p.error(f"--matrix {args.matrix} applies to --optimizer muon only (AdamW steps a flat 1/N slice)")
    try:
        args.matrix = parse_matrix(args.matrix) if args.matrix is not None else None
    except ValueError as exc:
        p.error(str(exc))
    return args


def _report_lines(args, world: int, dtype: torch.dtype, device: torch.device, stepped: str, source: str,
                  pred: Prediction, packed: Optional[Prediction]) -> List[str]:
    """The probe's printed report (``--json`` prints the same numbers)."""
    lines = [
        f"acco.probe: {world} rank(s), {args.params / 1e6:.1f}M parameters, {dtype}, {device.type}, {stepped}",
        f"  half mini-batch compute: {pred.compute_half_s * 1e3:8.1f} ms ({source})",
        f"  one round:               {pred.round_s * 1e3:8.1f} ms (measured, slowest rank)",
        f"  update, sync ZeRO-1:     {pred.sync_update_s * 1e3:8.1f} ms  = compute + round",
        f"  update, acco:            {pred.acco_update_s * 1e3:8.1f} ms  = max(compute, 2 x round)",
        f"  predicted speedup:       {pred.speedup:8.2f}x",
        f"  recommendation: {pred.recommendation}",
    ]
    if packed is not None:
        c = _compressed(pred, packed)
        lines += [
            f"  one {args.compression} round:          {packed.round_s * 1e3:8.1f} ms (measured, slowest rank)",
            f"  update, acco + {args.compression}:     {packed.acco_update_s * 1e3:8.1f} ms  = max(compute, 2 x "
            f"{args.compression} round)",
            f"  predicted speedup:       {c['speedup']:8.2f}x sync ZeRO-1 (full-width rounds), "
            f"{c['vs_acco']:.2f}x acco without compression",
        ]
    if world == 1:
        lines.append("  note: one process has no network; run it under torchrun on your nodes.")
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    args = _parse(argv)
    from .launch import init_process_group

    if "RANK" in os.environ and not dist.is_initialized():
        init_process_group()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    dtype = names[args.dtype] if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    world = dist.get_world_size() if dist.is_initialized() else 1

    optimizer_class = torch.optim.Muon if args.optimizer == "muon" else torch.optim.AdamW
    round_s = _all_max(measure_round(args.params, dtype, device, args.rounds, optimizer_class=optimizer_class,
                                     matrix=args.matrix), device)
    if args.matrix is None:
        stepped = f"{optimizer_class.__name__} on a flat slice"
    else:
        count = matrix_count(args.params, args.matrix)
        stepped = (f"{optimizer_class.__name__} on {count} whole {args.matrix[0]}x{args.matrix[1]} matrices "
                   f"({count * math.prod(args.matrix) / 1e6:.1f}M elements)")
    if args.compute_seconds is not None:
        compute_s, source = args.compute_seconds, "given"
    else:
        compute_s = 6 * args.params * args.tokens / matmul_flops(dtype, device)
        compute_s, source = _all_max(compute_s, device), "estimated from matmul FLOP/s (optimistic)"
    pred = predict(compute_s, round_s, args.microbatches_per_half)
    packed = None
    if args.compression is not None:
        packed_s = _all_max(measure_round(args.params, dtype, device, args.rounds, optimizer_class=optimizer_class,
                                          matrix=args.matrix, compression=args.compression), device)
        packed = predict(compute_s, packed_s, args.microbatches_per_half)
    if not dist.is_initialized() or dist.get_rank() == 0:
        if args.json:
            print(json.dumps({**asdict(pred), "ranks": world, "params": args.params, "dtype": str(dtype),
                              "device": device.type, "compute_source": source, "stepped": stepped,
                              **({} if packed is None else {"compression": args.compression,
                                                             "compressed": _compressed(pred, packed)})}))
        else:
            print("\n".join(_report_lines(args, world, dtype, device, stepped, source, pred, packed)))
    if dist.is_initialized():
        gc.collect()  # free gloo's finished work (and its tensors) while the group still exists
        dist.barrier()  # no rank tears its group down while another still talks on it
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
