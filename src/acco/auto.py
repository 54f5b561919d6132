"""``compression="auto"``: the wire format chosen from the link, measured on the run's own rounds.

The first updates run the uncompressed rounds (the default's: the bf16 estimate, the exact commit). After
them, every rank reads what its rounds and its compute took over a window of updates (``Measurement``), the
ranks agree on the slowest figures, and :func:`choose` predicts each format's update time from them:

* a round's time is ``fixed + per_byte * bytes`` (the bytes a rank sends, :func:`wire_bytes`), fitted on the
  two sizes the uncompressed rounds have (the narrow estimate and the exact commit); with one size, the round
  is taken as all link (``fixed = 0``); a compressed format's round adds its quantizers' time on this device
  (:func:`codec_seconds`, timed at the decision);
* an update of mode acco is ``max(h1, commit round) + max(h2, estimate round)``, each round hidden behind the
  micro-batches it overlaps (``h1`` before the estimate's hand-off, ``h2`` after it); mode dpu
  ``max(compute, commit round)``; mode sync ``compute + commit round``.

It takes the least compressed format (none, then ``quantize.KINDS`` by falling bits: int8 before int4) whose
update stays compute-bound, a compressed format's rounds predicted with a margin (``MARGIN``), else the
fastest so predicted (mode sync, which hides nothing: the fastest), and switches only when that saves at least
``MIN_SAVING`` of the uncompressed update and ``MIN_SAVING_S`` seconds: compression costs some convergence, so
the fewest bits that hide the round are spent only where the round is the link's, not its latency's. The
choice is logged on every rank, kept in checkpoints, and taken at an update's first hand-off, with no round in
flight, so what follows is a run of that format from a zero residual (``docs/compression.md``).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .modes import Mode
from .quantize import KINDS, dequantize_add_, packed_size, quantize

__all__ = ["AutoCompression", "Measurement", "choose", "fit_round", "make", "predict_update", "wire_bytes"]

log = logging.getLogger("acco")

AUTO = "auto"
NONE = "none"  # the uncompressed rounds, as a choice (a state's description says "none")
WARMUP_UPDATES = 1  # updates not measured after the synchronous ones (the first update's allocations, warm-up)
WINDOW_UPDATES = 2  # updates measured: their compute, and the rounds handed off in them
MARGIN = 0.7  # a compressed format hides its rounds if predicted to fill at most this share of their compute
SLACK = 1.05  # an update within 5% of its compute counts as compute-bound (its rounds hidden)
MIN_SAVING = 0.10  # of the uncompressed update's predicted time
MIN_SAVING_S = 0.002


def candidates() -> List[str]:
    """The formats auto chooses among, most faithful first: none, then the kinds by falling bits (fp8 is int8's
    width with a coarser grid: not a candidate)."""
    kinds = sorted((k for k in KINDS if k != "fp8"), key=lambda k: -KINDS[k].bits)
    return [NONE] + kinds


def wire_bytes(kind: str, padded_numel: int, shard_size: int, world_size: int, block: int, weights: bool,
               reduce_dtype: torch.dtype, compute_dtype: torch.dtype,
               estimate_dtype: Optional[torch.dtype]) -> Tuple[int, int]:
    """Bytes of (an estimate round, a commit round) on this rank's wire buffers: the gradients out and the
    weights in. ``kind``: ``"none"`` (the gradients in ``reduce_dtype``, the weights in ``compute_dtype``, the
    estimate in ``estimate_dtype`` when set) or a ``quantize.KINDS`` key. Only their ratios are used: every
    collective here sends ``(N-1)/N`` of its buffer. Pure."""
    if kind == NONE:
        commit = padded_numel * (reduce_dtype.itemsize + compute_dtype.itemsize)
        estimate = commit if estimate_dtype is None else 2 * padded_numel * estimate_dtype.itemsize
        return estimate, commit
    packed = world_size * packed_size(shard_size, block, kind)
    both = packed + (packed if weights else padded_numel * compute_dtype.itemsize)
    return both, both


def codec_seconds(kinds: Sequence[str], padded_numel: int, world_size: int, block: int, device: Any,
                  sample: int = 1 << 20) -> Dict[str, float]:
    """Seconds a round of each of ``kinds`` spends quantizing and dequantizing on this device (its arithmetic,
    not its bytes): timed on ``min(padded_numel, sample)`` elements, scaled to the round's passes (the
    gradients quantized once and dequantized twice, the residual's pass included; the weights' change
    quantized on this rank's share and dequantized whole). A quantizer much slower than the link (a CPU's)
    would otherwise make a format look faster than it is. No collective; CUDA: synchronizes the device."""
    n = max(1, min(padded_numel, sample))
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, generator=g).to(device)
    out = torch.zeros(n, dtype=torch.float32, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda" else (lambda: None)
    timed: Dict[str, float] = {}
    for kind in kinds:
        packed = torch.empty(packed_size(n, block, kind), dtype=torch.uint8, device=device)
        quantize(x, kind, block, packed)  # warm-up: kernels, allocations
        dequantize_add_(packed, kind, block, n, out)
        sync()
        t0 = time.perf_counter()
        quantize(x, kind, block, packed)
        sync()
        t1 = time.perf_counter()
        dequantize_add_(packed, kind, block, n, out)
        sync()
        t2 = time.perf_counter()
        per_q, per_d = (t1 - t0) / n, (t2 - t1) / n
        timed[kind] = padded_numel * (per_q * (1 + 1 / world_size) + 3 * per_d)
    return timed


def fit_round(samples: Sequence[Tuple[int, float]]) -> Tuple[float, float]:
    """``(fixed, per_byte)`` seconds of a round from ``(bytes, seconds)`` samples: the line through the two
    sizes' medians, both terms at least 0; one size: all of it per byte. Pure."""
    by_size: Dict[int, List[float]] = {}
    for n, s in samples:
        by_size.setdefault(n, []).append(s)
    if not by_size:
        raise ValueError("fit_round: no samples")
    sizes = sorted(by_size)
    small, large = sizes[0], sizes[-1]
    t_small, t_large = statistics.median(by_size[small]), statistics.median(by_size[large])
    if large == small:
        return 0.0, t_large / large
    per_byte = max(0.0, (t_large - t_small) / (large - small))
    return max(0.0, t_large - per_byte * large), per_byte


def predict_update(mode: Mode, compute_s: float, first_share: float, estimate_s: float, commit_s: float) -> float:
    """Seconds of one update: ``compute_s`` of forward and backward, ``first_share`` of it before the
    estimate's hand-off (mode acco), each round overlapped with the compute it runs beside. Pure."""
    if mode.estimates:
        first = compute_s * first_share
        return max(first, commit_s) + max(compute_s - first, estimate_s)
    if mode.synchronous:
        return compute_s + commit_s
    return max(compute_s, commit_s)  # dpu: the commit runs beside the next update


@dataclass(frozen=True)
class Measurement:
    """What the window of updates took on one rank (seconds): compute per update (waiting for rounds
    excluded), and the median round of each kind (None where the window had none)."""

    compute_s: float
    estimate_s: Optional[float]
    commit_s: float
    codec_s: Tuple[Tuple[str, float], ...] = ()  # each compressed kind's quantizer time per round

    def as_row(self) -> List[int]:
        """Microseconds, for the ranks' exchange of int rows (-1: no estimate round), the codec's in
        ``codec_s``'s order."""
        us = lambda s: int(round(s * 1e6))  # noqa: E731
        return ([us(self.compute_s), -1 if self.estimate_s is None else us(self.estimate_s), us(self.commit_s)]
                + [us(v) for _, v in self.codec_s])

    @staticmethod
    def slowest(rows: Sequence[Sequence[int]], kinds: Sequence[str] = ()) -> "Measurement":
        """The ranks' rows (:meth:`as_row`, the codec's for ``kinds``) as one: each figure the largest (the
        slowest rank sets the pace)."""
        compute, estimate, commit, *codec = (max(col) / 1e6 for col in zip(*rows))
        return Measurement(compute, None if estimate < 0 else estimate, commit, tuple(zip(kinds, codec)))


def choose(m: Measurement, mode: Mode, first_share: float, sizes: Dict[str, Tuple[int, int]]) -> Tuple[str, Dict[str, float]]:
    """The format to use (a key of ``sizes``, ``"none"`` first) and each one's predicted update time, from the
    uncompressed rounds' measurement ``m``. ``sizes``: :func:`wire_bytes` of every candidate.

    The first format (none, then by falling bits) whose update stays compute-bound: none by its measured rounds,
    a compressed one with its predicted rounds taken as ``1 / MARGIN`` longer (what a prediction from the
    uncompressed rounds leaves out: the round's own work competing with the compute on a shared device). If
    none does, the fastest so predicted. Pure."""
    e_bytes, c_bytes = sizes[NONE]
    samples = [(c_bytes, m.commit_s)] + ([(e_bytes, m.estimate_s)] if m.estimate_s is not None else [])
    fixed, per_byte = fit_round(samples)
    codec = dict(m.codec_s)

    def update(k: str, scale: float) -> float:
        e, c = sizes[k]
        return predict_update(mode, m.compute_s, first_share, scale * (fixed + per_byte * e + codec.get(k, 0.0)),
                              scale * (fixed + per_byte * c + codec.get(k, 0.0)))

    predicted = {k: update(k, 1.0) for k in sizes}
    cautious = {k: update(k, 1.0 if k == NONE else 1 / MARGIN) for k in sizes}
    bound = mode.synchronous or not any(cautious[k] <= SLACK * m.compute_s for k in sizes)
    chosen = (min(sizes, key=lambda k: (cautious[k], list(sizes).index(k))) if bound
              else next(k for k in sizes if cautious[k] <= SLACK * m.compute_s))
    saving = predicted[NONE] - predicted[chosen]
    if chosen != NONE and (saving < MIN_SAVING * predicted[NONE] or saving < MIN_SAVING_S):
        chosen = NONE
    return chosen, predicted


def make(precision: Any, layout: Any, world_size: int, mode: Mode, skip_updates: int, build: Any,
         device: Any) -> Optional["AutoCompression"]:
    """``compression="auto"``'s owner for a run (None for any other ``compression``): each candidate's bytes per
    round on this ``layout``, ``build(kind)`` (``FlatBuffers.build_transport``) for the switch, and a residual's
    like for a load (on ``device``, or another: ``"meta"`` for its shape)."""
    pr = precision
    if pr.compression != AUTO:
        return None
    sizes = {k: wire_bytes(k, layout.padded_numel, layout.shard_size, world_size, pr.compression_block,
                           pr.compression_weights, pr.reduce_dtype, pr.compute_dtype, pr.estimate_dtype)
             for k in candidates()}
    kinds = [k for k in sizes if k != NONE]
    return AutoCompression(mode, skip_updates, sizes, build,
                           lambda on=None: torch.empty(layout.padded_numel, dtype=pr.accumulation_dtype,
                                                       device=device if on is None else on),
                           lambda: codec_seconds(kinds, layout.padded_numel, world_size, pr.compression_block, device))


class AutoCompression:
    """The one owner of auto's decision: ``decided`` (None until then, else ``"none"`` or a kind), the window it
    measures, and the switch. ``measure`` reads the driver's record of the window; ``build(kind)`` makes that
    format's transport (``FlatBuffers.build_transport``)."""

    def __init__(self, mode: Mode, skip_updates: int, sizes: Dict[str, Tuple[int, int]], build: Any,
                 residual_like: Any, time_codec: Any) -> None:
        self.mode, self.sizes, self.build, self.residual_like = mode, sizes, build, residual_like
        self.time_codec = time_codec  # () -> {kind: seconds of its quantizer per round} (codec_seconds)
        self.decided: Optional[str] = None
        self.predicted: Dict[str, float] = {}
        self.measured: Optional[Measurement] = None
        self.measure_from = self.decide_at = 0
        self._open_window(skip_updates)

    def _open_window(self, commits: int) -> None:
        """Measure the updates after ``commits + WARMUP_UPDATES`` commits, ``WINDOW_UPDATES`` of them."""
        self.measure_from = commits + WARMUP_UPDATES  # commits handed off when the window opens
        self.decide_at = self.measure_from + WINDOW_UPDATES

    def due(self, commits: int) -> bool:
        """Whether an update's first hand-off, after ``commits`` commits, is where auto decides."""
        return self.decided is None and commits >= self.decide_at

    def decide(self, driver: Any, session: Any, first_share: float) -> None:
        """Measure the window, agree on the slowest figures, choose, and have the driver switch now, between
        updates (``first_share``: mode acco, the share of an update's micro-batches before its estimate).
        Collective on the control group, then on the model group (DTensor parameters): one exchange each, once per
        run (again after a load that left it open)."""
        driver.collect()  # the last commit of the window: its round is one of the samples
        kinds = [k for k in self.sizes if k != NONE]
        error, mine = None, None
        try:
            mine = driver.measure_updates(self.measure_from - 1, self.decide_at - 1)
            if mine is not None:  # and the quantizers' time on this device, no round in flight
                codec = self.time_codec()  # every kind timed once
                mine = dataclasses.replace(mine, codec_s=tuple((k, codec[k]) for k in kinds))
        except Exception as exc:  # every rank hears of it in the exchange, none waits in it alone
            error = exc
        width = 3 + len(kinds)
        row = [-2] * width if error is not None else mine.as_row() if mine is not None else [-1] * width
        rows = session.gather_row(row, "step() (compression='auto' choosing its format)")
        failed = [r for r, row in enumerate(rows) if row[0] == -2]
        anew = min(r[0] for r in rows) < 0  # a rank without the window's stamps (resumed inside it)
        # The replica groups of the model's other shards (FSDP2, tensor parallel inside a host) decide as one:
        # the worst outcome (2 failed, 1 measure anew) and the slowest figures over all of them.
        status, *slowest = driver.max_over_shards(
            [2 if failed else 1 if anew else 0, *([0] * width if anew else Measurement.slowest(rows, kinds).as_row())])
        if status == 2:
            where = f"rank(s) {failed} of this replica group" if failed else "a rank of another shard's replicas"
            raise RuntimeError(f"compression='auto' could not measure its window on {where}: "
                               f"{error or 'see that rank'}") from error
        driver.stamps.clear()
        if status == 1:  # measure anew, every rank
            self.restart(driver.progress.commits_handed_off, driver)
            return
        self.measured = Measurement.slowest([slowest], kinds)
        kind, self.predicted = choose(self.measured, self.mode, first_share, self.sizes)
        x = self.measured.commit_s / max(self.measured.compute_s / 2, 1e-12)
        log.info("acco: compression='auto' chose %s: per update %.3f s of compute, an exact round %.3f s "
                 "(x = %.2f), the quantizers %s; predicted update time %s", kind, self.measured.compute_s,
                 self.measured.commit_s, x, ", ".join(f"{k} {v:.3f} s" for k, v in self.measured.codec_s),
                 ", ".join(f"{k} {v:.3f} s" for k, v in self.predicted.items()))
        self.take(kind, driver)

    def take(self, kind: str, driver: Any) -> None:
        """Use ``kind`` from now on (decided, or a checkpoint's): the driver installs its transport."""
        self.decided = kind
        driver.switch_transport(self.build(kind))

    def restart(self, commits: int, driver: Any) -> None:
        """Undecided, the uncompressed rounds again, and a window that opens after ``commits`` commits."""
        self.decided, self.measured, self.predicted = None, None, {}
        self._open_window(commits)
        driver.stamps.clear()
        driver.stamp_upto = self.decide_at
        driver.switch_transport(self.build(NONE))

    def saved_kind(self, info: Dict[str, Any]) -> str:
        """The format a load takes from a state's description: the saving run's choice where it had made one
        (``"auto"`` in it), else none (then it decides anew). Raises for a choice it does not know."""
        saved = info.get("auto", "undecided")
        if saved == "undecided":
            return NONE
        if saved not in self.sizes:
            raise ValueError(f"the state was saved by compression='auto' that chose {saved!r}; this acco chooses "
                             f"among {list(self.sizes)}. Nothing was loaded")
        return saved

    def loaded(self, info: Dict[str, Any], driver: Any) -> None:
        """After a load (no round in flight): the saving run's choice, or an open window from here."""
        if info.get("auto", "undecided") == "undecided":
            self.restart(driver.progress.commits_handed_off, driver)
        else:
            self.take(self.saved_kind(info), driver)
