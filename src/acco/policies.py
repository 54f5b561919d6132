"""The options of an :class:`~acco.AccoOptimizer`, grouped into frozen policies, each with its own checks.

Each policy is a frozen dataclass (as FSDP2's ``MixedPrecisionPolicy``); each field is also a keyword of
``AccoOptimizer(...)`` (``max_grad_norm=1.0`` is ``robustness=RobustnessPolicy(max_grad_norm=1.0)``). A field
carries its default's wording and its documentation (``metadata``): the class docstrings, ``help()`` and the
tables of ``docs/options.md`` are made from them (``options.markdown_table``), and the agreement between ranks
and the state dict's description read every field (``Options.agreed``). A policy's ``checked`` raises with what
was received and what to pass instead; ``resolved`` fills what depends on the model and the group.

Adding an option: a field in the policy it belongs to, its check in that policy's ``checked``, and the code
that reads ``options.<policy>.<field>``.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

import torch

from . import precision as P
from .modes import Mode
from .auto import AUTO
from .quantize import KINDS

__all__ = ["ACCO_NEEDS_TWO", "AUTO_EXTRAPOLATION", "DelayPolicy", "HandoffPolicy", "OuterPolicy", "POLICIES",
           "PrecisionPolicy", "RobustnessPolicy", "check_estimate_within", "check_per_update",
           "resolve_estimate_extrapolation"]


def option(default: Any, shown: str, doc: str) -> Any:
    """A policy field: its ``default``, how the table shows the default (``shown``), and what it does (``doc``,
    markdown: the docstring and ``docs/options.md`` read it)."""
    return field(default=default, metadata={"shown": shown, "doc": doc})


def documented(cls: type) -> type:
    """Append each field's documentation to the policy's docstring (what ``help()`` shows)."""
    lines = [f"    {f.name} (default {f.metadata['shown']}): {f.metadata['doc']}" for f in dataclasses.fields(cls)]
    cls.__doc__ = (cls.__doc__ or "") + "\n\n    Fields:\n" + "\n".join(lines) + "\n"
    return cls


def _is_int(value: Any, at_least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= at_least


ACCO_NEEDS_TWO = (
    "mode='acco' splits each update's micro-batches into two halves (an estimate from the first, the update from "
    "both), but got {m} backward() per step(). Run two (or more) micro-batches of half the size per step() "
    "(gradient accumulation: backward() on each, then one step()), or use mode='dpu' or mode='sync'"
)


def check_per_update(mode: Mode, per_update: Any) -> None:
    """``microbatches_per_update``: None (learned from the first update) or an int >= 1, >= 2 in mode acco."""
    if per_update is not None:
        if not _is_int(per_update, 1):
            raise ValueError(f"microbatches_per_update must be None or an int >= 1, got {per_update!r}")
        if mode.estimates and per_update < 2:
            raise ValueError(ACCO_NEEDS_TWO.format(m=per_update))


@documented
@dataclass(frozen=True)
class HandoffPolicy:
    """When a round is handed off: one ``step()`` per update (the default), or the loop for ranks of unequal
    speed (``docs/usage.md``, "Accumulate while communicating")."""

    accumulate_while_communicating: bool = option(False, "`False`", (
        "The loop for ranks of unequal speed: `step()` after every micro-batch, and a rank keeps accumulating "
        "while a round is in flight ([usage](usage.md#accumulate-while-communicating)). Each round then averages "
        "over all micro-batches of all ranks. Off by default (deterministic)."))
    min_microbatches: int = option(1, "`1`", (
        "With `accumulate_while_communicating` only: the micro-batches accumulated before a hand-off."))
    max_microbatches: Optional[int] = option(None, "`None`", (
        "With `accumulate_while_communicating` only: the most micro-batches accumulated while a round is in "
        "flight (`None`: no bound)."))
    divide_by_ranks: bool = option(True, "`True`", (
        "Whether a round divides the ranks' summed gradients by their number, as DDP does. `False`: the ranks' "
        "gradients are added, for a loss already normalized over every rank's batch (torchtitan divides each "
        "rank's loss by the global token count, and sums across ranks). With `outer_every`, the loss is normalized "
        "over every region's ranks' batch and the region's sum multiplied by the number of regions. One `step()` "
        "per update only."))

    def checked(self, mode: Mode, per_update: Any) -> "HandoffPolicy":
        elastic, low, high = self.accumulate_while_communicating, self.min_microbatches, self.max_microbatches
        check_per_update(mode, per_update)
        if not isinstance(elastic, bool):
            raise TypeError(f"accumulate_while_communicating must be True or False, got {elastic!r}")
        if not isinstance(self.divide_by_ranks, bool):
            raise TypeError(f"divide_by_ranks must be True or False, got {self.divide_by_ranks!r}")
        if elastic and not self.divide_by_ranks:
            raise ValueError(
                "divide_by_ranks=False does not apply with accumulate_while_communicating=True: each round then "
                "averages over all micro-batches of all ranks, however many each ran. Keep divide_by_ranks=True, "
                "with each micro-batch's loss a mean over its own tokens"
            )
        if elastic and per_update is not None:
            raise ValueError(
                "microbatches_per_update does not apply with accumulate_while_communicating=True (step() is then "
                "called after every micro-batch and the library decides when to hand off); pass one or the other"
            )
        if not elastic and (low != 1 or high is not None):
            raise ValueError(
                f"min_microbatches={low!r}/max_microbatches={high!r} apply only with "
                "accumulate_while_communicating=True (step() after every micro-batch). With one step() per update, "
                "run the micro-batches you want per update (microbatches_per_update=...) and call step() once"
            )
        if not _is_int(low, 1):
            raise ValueError(f"min_microbatches must be an int >= 1, got {low!r}")
        if high is not None:
            if not isinstance(high, int) or isinstance(high, bool):
                raise ValueError(f"max_microbatches must be None or an int, got {high!r}")
            if high < low:
                raise ValueError(
                    f"min_microbatches={low} > max_microbatches={high}: "
                    "raise max_microbatches (or pass None for no bound) or lower min_microbatches"
                )
        return self


@documented
@dataclass(frozen=True)
class RobustnessPolicy:
    """What a round does with a large or non-finite gradient, and how long it waits for a peer."""

    max_grad_norm: Optional[float] = option(None, "`None`", (
        "Clip the global L2 norm of the averaged gradient, as `clip_grad_norm_` on DDP's gradient would. "
        "Clipping `.grad` yourself raises: here `.grad` holds the local gradient."))
    nonfinite: str = option("skip", '`"skip"`', (
        "An update whose averaged gradient holds inf/NaN is skipped on every rank (counted in "
        '`num_skipped_updates`), or `"raise"`s `acco.NonFiniteGradientError`. A finite one is stepped whatever '
        "its size (its norm is summed in fp64), as `torch.optim` steps it."))
    timeout: Optional[datetime.timedelta] = option(None, "the group's default", (
        "How long a round's collectives wait for a peer before raising. It also bounds the first exchange of "
        "`finish()`, `load_state_dict()` and `acco.checkpoint.save/load/gather`, so a call made on only some "
        "ranks raises after it instead of hanging."))

    def checked(self) -> "RobustnessPolicy":
        norm, timeout = self.max_grad_norm, self.timeout
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm > 0):
            raise ValueError(f"max_grad_norm must be None or a number > 0, got {norm!r}")
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise', got {self.nonfinite!r}")
        if timeout is not None:
            if not isinstance(timeout, datetime.timedelta):
                raise TypeError(
                    f"timeout must be a datetime.timedelta (how long a round waits for a peer), got {timeout!r}")
            if timeout <= datetime.timedelta(0):
                raise ValueError(
                    f"timeout={timeout!r}: a round's collectives would give up at once and blame a dead peer; pass "
                    "a positive datetime.timedelta (e.g. timedelta(minutes=10)) or None for the process group's "
                    "default"
                )
        return self


AUTO_EXTRAPOLATION = 1.2  # docs/convergence.md, "How a default is chosen": measured with AdamW only


@documented
@dataclass(frozen=True)
class DelayPolicy:
    """Against the one-step delay, beyond the paper: the warm-up, where the estimate is handed off, how far it
    steps, and mode dpu's error feedback (``docs/algorithm.md``)."""

    synchronous_updates: int = option(0, "`0`", (
        "The first this many updates run synchronously (no estimate, no overlap), as the paper warms DPU up. "
        "Counted in committed updates, so a resumed run does not repeat them. One `step()` per update only "
        "(refused with `accumulate_while_communicating`)."))
    estimate_microbatches: Optional[int] = option(None, "`None`", (
        "Mode `acco`: hand the estimate round off after `h` of the update's `M` micro-batches (`1 ≤ h < M`) "
        "instead of `M // 2`. Its gradients are extrapolated to `M`. The commit then hides behind `h` "
        "micro-batches and the estimate behind `M − h`. Refused in other modes and with "
        "`accumulate_while_communicating`."))
    estimate_extrapolation: Union[float, str] = option("auto", '`"auto"`', (
        "Mode `acco`: the estimate takes its step `c` times, `θ̃ = θ + c·(Opt*(θ, ĝ) − θ)`, with `c` in `(0, 2]` "
        "(`1.0`: the paper's). The commit is unchanged. Free for Adam, AdamW and SGD; one `lerp` per tensor for "
        'other optimizers. `"auto"`: `1.2` with one `step()` per update and `estimate_microbatches` unset when '
        "every wrapped optimizer is Adam or AdamW (measured with AdamW: [how a default is chosen]"
        "(convergence.md#how-a-default-is-chosen)), `1.0` elsewhere (not measured). The resolved value: "
        "`opt.estimate_extrapolation`."))
    delay_correction: float = option(0.0, "`0.0`", (
        "Mode `dpu`: error feedback against the one-step-stale gradient (Zmushko et al., ICML 2026), "
        "`θ_{k+1} = θ_k − u_k − c·(u_k − u_{k−1})`, with `c` in `[0, 2]` (the paper's is `1.0`). Works with any "
        "optimizer and needs no extra communication. It costs one slice of state (checkpointed) and one of "
        "scratch. Refused in modes `acco` and `sync`, which take no stale gradient, and with "
        "`accumulate_while_communicating` ([algorithm](algorithm.md#the-one-step-delay-of-2026-error-feedback-"
        "and-what-it-means-for-acco))."))

    def checked(self, mode: Mode, per_update: Any, elastic: bool) -> "DelayPolicy":
        """Checked against the mode and the hand-offs; the two numbers as floats (``"auto"`` kept)."""
        warmup, h = self.synchronous_updates, self.estimate_microbatches
        if not _is_int(warmup, 0):
            raise ValueError(f"synchronous_updates must be an int >= 0, got {warmup!r}")
        if elastic and warmup:
            raise ValueError(
                "synchronous_updates applies to one step() per update; with accumulate_while_communicating=True the "
                "hand-offs follow the rounds. Drop it, or drop accumulate_while_communicating"
            )
        if h is not None:
            if not _is_int(h, 1):
                raise ValueError(f"estimate_microbatches must be None or an int >= 1, got {h!r}")
            if not mode.estimates:
                raise ValueError(f"estimate_microbatches={h} applies to mode='acco' only (it places the estimate "
                                 f"round), got mode={mode!r}: drop it")
            if elastic:
                raise ValueError(
                    f"estimate_microbatches={h} applies to one step() per update; with "
                    "accumulate_while_communicating=True the hand-offs follow the rounds (min_microbatches bounds "
                    "them). Drop it, or drop accumulate_while_communicating"
                )
            if per_update is not None:
                check_estimate_within(h, per_update)
        return dataclasses.replace(self, estimate_extrapolation=_check_extrapolation(mode, self.estimate_extrapolation),
                                   delay_correction=_check_delay_correction(mode, elastic, self.delay_correction))

    def resolved(self, mode: Mode, elastic: bool, classes: Iterable[type]) -> "DelayPolicy":
        """``estimate_extrapolation="auto"`` resolved against the groups' optimizer ``classes``."""
        c = resolve_estimate_extrapolation(self.estimate_extrapolation, mode, elastic, self.estimate_microbatches,
                                           classes)
        return dataclasses.replace(self, estimate_extrapolation=c)


def _check_extrapolation(mode: Mode, c: Any) -> Union[float, str]:
    """``estimate_extrapolation``: ``theta~ = theta + c * (Opt*(theta, g) - theta)`` (mode acco); ``1.0`` is the
    paper's estimate. ``"auto"`` as it is, a number as a float."""
    if isinstance(c, str) and c == "auto":
        return c
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or not 0 < c <= 2:
        raise ValueError(
            f"estimate_extrapolation must be 'auto' or a number in (0, 2], got {c!r}: 1.0 is the paper's estimate, "
            "1.2 what 'auto' takes for Adam and AdamW (docs/settings.md)"
        )
    if c != 1 and not mode.estimates:
        raise ValueError(f"estimate_extrapolation={c} applies to mode='acco' only (its estimate round), got "
                         f"mode={mode!r}: drop it")
    return float(c)


def _check_delay_correction(mode: Mode, elastic: bool, c: Any) -> float:
    """``delay_correction``: the error feedback's ``c`` on mode dpu's delayed updates (0: none), as a float."""
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or not 0 <= c <= 2:
        raise ValueError(f"delay_correction must be a number in [0, 2], got {c!r}: 0 is none, 1.0 the setting of "
                         "Zmushko et al. (docs/algorithm.md)")
    if c != 0 and not mode.delayed:
        raise ValueError(
            f"delay_correction={c} applies to mode='dpu' only (a step taken from a one-step-stale gradient), got "
            f"mode={mode!r}: mode acco takes no stale gradient (its estimate predicts theta instead; "
            "estimate_extrapolation tunes it), mode sync none at all. Drop it, or pass mode='dpu'")
    if c != 0 and elastic:
        raise ValueError(f"delay_correction={c} needs one step() per update: got accumulate_while_communicating=True "
                         "(each rank's rounds then end at points of its own). Drop one of the two")
    return float(c)


def resolve_estimate_extrapolation(c: Union[float, str], mode: Mode, accumulate_while_communicating: bool,
                                   estimate_microbatches: Optional[int], classes: Iterable[type]) -> float:
    """``"auto"`` (the default): ``1.2`` in mode acco with one ``step()`` per update and the paper's hand-off (the
    first half, ``estimate_microbatches`` None) when every wrapped optimizer is ``torch.optim.Adam`` or ``AdamW``
    (measured with AdamW; Adam takes the same step on its moments); ``1.0``, the paper's estimate, anywhere else,
    where nothing was measured. A number stays as checked."""
    if c != "auto":
        return float(c)
    adam = all(cls in (torch.optim.Adam, torch.optim.AdamW) for cls in classes)
    fixed = not accumulate_while_communicating and estimate_microbatches is None
    return AUTO_EXTRAPOLATION if mode.estimates and fixed and adam else 1.0


def check_estimate_within(h: int, m: int) -> None:
    """The estimate's hand-off must leave at least one micro-batch of the update after it (``m`` given or learned)."""
    if h >= m:
        raise ValueError(
            f"estimate_microbatches={h} with {m} micro-batches per update: the estimate round is handed off after "
            f"{h} of them and needs at least one after it to overlap with. Pass an estimate_microbatches below {m} "
            "(None: the first half), or run more micro-batches per update"
        )


@documented
@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtype of each copy and each message (FSDP2's ``MixedPrecisionPolicy``): the master stays fp32.
    ``precision.py`` checks each dtype against the others."""

    compute_dtype: Optional[torch.dtype] = option(None, "the parameters' dtype", (
        "The model's copy, e.g. `torch.bfloat16`. The sharded master stays fp32. `torch.float16` is refused: use "
        "bf16, or fp32 parameters under fp16 autocast with a `GradScaler` ([fp16](fp16.md))."))
    accumulation_dtype: Optional[torch.dtype] = option(None, "fp32 for bf16 compute, else the compute dtype", (
        "The dtype gradients are summed in, over micro-batches and ranks. When it differs from the compute dtype, "
        "`.grad` is a compute-dtype buffer of its own (one more copy of the model). It may not be narrower than "
        "the compute dtype; fp16 is refused."))
    reduce_dtype: Optional[torch.dtype] = option(None, "the accumulation dtype", (
        "The dtype gradients travel and are summed over ranks in (FSDP2's `reduce_dtype`). `torch.bfloat16` with "
        "a bf16 model is the paper's bytes ([benchmarks](benchmarks.md)). It must be at least as wide as the "
        "compute dtype and at most as wide as the accumulation dtype; fp16 is refused."))
    estimate_dtype: Union[torch.dtype, str, None] = option("auto", '`"auto"`', (
        "Mode `acco`: the estimate round travels in this dtype, its weights as the change against the weights "
        "every rank holds (the dtype rounds the change, never a weight), and the commit stays exact. `\"auto\"` is "
        "`torch.bfloat16` for an fp32 model whose gradients travel in fp32 between more than one rank, else "
        "`None` (a bf16 model's weights already travel in bf16; with its default fp32 reduce it can opt in). "
        "`None`: the paper's exact estimate. The resolved dtype is `opt.estimate_dtype`. An explicit dtype is "
        "refused outside mode acco, or when it is not narrower than `reduce_dtype`. On NCCL, with the bf16 "
        "estimate, ranks that run different numbers of micro-batches hang until the timeout instead of raising "
        "`RoundMismatchError`; `None` keeps the error ([settings](settings.md))."))

    compression: Optional[str] = option(None, "`None`", (
        '`"int8"`, `"fp8"` (e4m3) or `"int4"`: the gradients travel in 8 (4) bits with an fp32 scale per block of '
        "`compression_block` elements, as an all-to-all of each rank's quantized chunks that every owner "
        "dequantizes and sums in fp32 (nothing is re-quantized on the way). Each rank keeps an error-feedback "
        "residual, a gradient-sized buffer in the accumulation dtype (checkpointed), so what a commit round's "
        "quantization drops is sent with the next one; the estimate round quantizes without feedback. `None`: "
        "the gradients travel in `reduce_dtype` ([algorithm](algorithm.md#compressed-rounds)). With it, "
        "`estimate_dtype` and `reduce_dtype` stay unset. `\"auto\"`: chosen once from the run's own rounds after its "
        "first updates: none, int8 or int4, the fewest bits that hide the round, where it is the link's "
        "([compression](compression.md#chosen-from-the-link-auto)); until then, and when it keeps none, `estimate_dtype` "
        "applies (`reduce_dtype` stays unset)."))
    compression_block: int = option(256, "`256`", (
        "With `compression`: the elements that share one scale (each 4 bytes more per block: 1.6% of the "
        "payload at 256). Smaller blocks follow the gradient's range more closely."))

    compression_weights: bool = option(True, "`True`", (
        "With `compression`: the weights travel in its bits too, each owner sending its change against the weights "
        "every rank holds (the fp32 master stays exact). `False`: only the gradients are compressed, and the "
        "weights travel in the compute dtype."))
    estimate_compression: Optional[str] = option(None, "`None`", (
        "Mode `acco` with `compression`: the estimate round's own kind (`\"int4\"` under `\"int8\"`: a quarter "
        "fewer bytes per update), its gradients and its weights' change alike. Its step is thrown away at the "
        "commit, so it needs no feedback; the commit keeps `compression` and its residual. `None`: the estimate "
        "travels as the commit does ([compression](compression.md#a-cheaper-estimate-round))."))

    def resolved(self, param_dtype: torch.dtype, mode: Mode, world_size: int) -> "PrecisionPolicy":
        """Every dtype concrete: ``compute_dtype`` None is the parameters'; the accumulation dtype from the compute
        dtype; the reduce dtype from the accumulation dtype; ``estimate_dtype="auto"`` from all three (None with
        ``compression``: the estimate is compressed like the commit)."""
        self._check_compression()
        if self.estimate_compression is not None and not mode.estimates:
            raise ValueError(f"estimate_compression={self.estimate_compression!r} applies to mode='acco' only (its "
                             f"estimate round), got mode={mode!r}: drop it")
        compute = self.compute_dtype or param_dtype
        accumulation = P.check_accumulation_dtype(self.accumulation_dtype, compute)
        reduce = P.check_reduce_dtype(self.reduce_dtype, accumulation, compute)
        if self.compression in (None, AUTO):  # auto starts, and may stay, without compression
            estimate = P.resolve_estimate_dtype(self.estimate_dtype, mode, compute, reduce, world_size)
        else:
            estimate = None
        return dataclasses.replace(self, compute_dtype=compute, accumulation_dtype=accumulation, reduce_dtype=reduce,
                                   estimate_dtype=estimate)

    def _check_compression(self) -> None:
        kind, block = self.compression, self.compression_block
        if kind is not None and kind != AUTO and kind not in KINDS:
            raise ValueError(f"compression must be None, {', '.join(map(repr, KINDS))} or {AUTO!r} (the kinds of "
                             f"quantize.KINDS, or chosen from the link), got {kind!r}")
        if not _is_int(block, 1):
            raise ValueError(f"compression_block must be an int >= 1 (elements per scale), got {block!r}")
        if not isinstance(self.compression_weights, bool):
            raise TypeError(f"compression_weights must be True or False, got {self.compression_weights!r}")
        estimate_kind = self.estimate_compression
        if estimate_kind is not None and estimate_kind not in KINDS:
            raise ValueError(f"estimate_compression must be None or one of {', '.join(map(repr, KINDS))}, got "
                             f"{estimate_kind!r}")
        if estimate_kind is not None and kind in (None, AUTO):
            raise ValueError(f"estimate_compression={estimate_kind!r} with compression={kind!r}: it sets the estimate "
                             "round's kind under an explicit compression of the commit (e.g. compression='int8', "
                             "estimate_compression='int4')"
                             + ("; compression='auto' chooses both rounds' format" if kind == AUTO else ""))
        if kind is None:
            return
        if self.reduce_dtype is not None:
            travel = "the kind it chooses" if kind == AUTO else kind
            raise ValueError(f"reduce_dtype={self.reduce_dtype} with compression={kind!r}: the gradients travel in "
                             f"{travel} and are summed in fp32 by their owner. Drop reduce_dtype")
        explicit_estimate = not (isinstance(self.estimate_dtype, str) and self.estimate_dtype == "auto")
        if kind != AUTO and self.estimate_dtype is not None and explicit_estimate:
            raise ValueError(f"estimate_dtype={self.estimate_dtype} with compression={kind!r}: the estimate round is "
                             "compressed like the commit. Drop estimate_dtype")


@documented
@dataclass(frozen=True)
class OuterPolicy:
    """Across regions (``docs/regions.md``): every ``outer_every`` updates, an outer round averages the regions'
    progress (``outer_group``: this rank's peers of the other regions) and takes an outer step, as DiLoCo does,
    with the outer state sharded as the optimizer's (``docs/algorithm.md``, "Across regions")."""

    outer_every: Optional[int] = option(None, "`None`", (
        "`H`: an outer round after every `H` updates, across the regions of `outer_group` (`None`: none; "
        "the rounds of `process_group` are then the only ones)."))
    outer_lr: float = option(0.7, "`0.7`", (
        "The outer step's learning rate (SGD on the regions' mean pseudo-gradient)."))
    outer_momentum: float = option(0.9, "`0.9`", (
        "The outer step's momentum, Nesterov's when > 0 (DiLoCo's 0.7 and 0.9); `outer_lr=1.0, "
        "outer_momentum=0.0` averages the regions' weights."))
    outer_compression: Optional[str] = option(None, "`None`", (
        "The pseudo-gradient's wire format across regions: `None` (fp32), `\"int8\"`, `\"int4\"` or `\"fp8\"` "
        "in blocks of `compression_block`, with error feedback (a residual of this rank's slice)."))
    outer_delay: int = option(0, "`0`", (
        "`τ`: the outer round runs behind the next `τ` updates and is merged at the commit `τ` updates after its "
        "launch, keeping those updates' progress (`0 ≤ τ < H`; `0`: merged before the launching commit's weights "
        "are published)."))

    def checked(self, elastic: bool) -> "OuterPolicy":
        every = self.outer_every
        if every is None:
            changed = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(f"{', '.join(changed)} without outer_every: they set the outer round, which runs "
                                 "only with outer_every=H (and outer_group=). Pass outer_every, or drop them")
            return self
        if not _is_int(every, 1):
            raise ValueError(f"outer_every must be None or an int >= 1 (updates between outer rounds), got {every!r}")
        if elastic:
            raise ValueError("outer_every with accumulate_while_communicating=True: the regions would count "
                             "different numbers of rounds, and an outer round needs them at the same update. Drop "
                             "one of the two")
        lr, momentum = self.outer_lr, self.outer_momentum
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"outer_lr must be a number > 0, got {lr!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"outer_momentum must be a number in [0, 1), got {momentum!r}")
        if self.outer_compression is not None and self.outer_compression not in KINDS:
            raise ValueError(f"outer_compression must be None or one of {', '.join(map(repr, KINDS))}, got "
                             f"{self.outer_compression!r}")
        if not _is_int(self.outer_delay, 0) or self.outer_delay >= every:
            raise ValueError(f"outer_delay must be an int with 0 <= outer_delay < outer_every={every} (one outer "
                             f"round in flight at a time), got {self.outer_delay!r}")
        return self


POLICIES = {"handoff": HandoffPolicy, "robustness": RobustnessPolicy, "delay": DelayPolicy,
            "precision": PrecisionPolicy, "outer": OuterPolicy}
"""Each policy by the name of its ``AccoOptimizer`` keyword and its ``Options`` field, in the fingerprints' order."""
