"""The CUDA code path itself, run on CPU over a simulated device (``fake_cuda.py``).

gloo carries the collectives; the fake device the ordering. Its side streams
run nothing until forced, so a missing event wait on the compute side gives
wrong numbers, and its race checker flags every access not ordered by an event
(including a side stream reading the hand-off before it was written). Each
configuration is checked against the oracle, and for races, host
synchronisations after the first update, and round tensors the allocator could
hand out while the side stream still uses them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from fake_cuda import FakeCuda
from oracle import Split, reference_run, update_run
from tinynet import flat, flat_list, grad_fn, loss_fn, make_model, rel_err

import acco.device_api
from acco import AccoOptimizer, StreamScheduler

TOL = 1e-5
UPDATES = 4
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
    "adamw_fused": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)),
    "sgd_plain": (torch.optim.SGD, dict(lr=5e-2)),  # keeps no state at all
    # whole-tensor placement: each tensor stepped whole by its owner rank, in its own shape
    "adafactor": (torch.optim.Adafactor, dict(lr=1e-2)),
    # the Muon + AdamW split: the two weight matrices to Muon (whole), the biases and shift to AdamW (sliced)
    "muon_split": ("split", dict(muon=dict(lr=0.02, momentum=0.95, weight_decay=0.01),
                                 adamw=dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))),
}
MATRICES = (1, 3)  # TinyNet's fc1.weight and fc2.weight (its own shift comes first)
# On a real GPU, AdamW runs fused by default (its step counter a device tensor); here "adamw" is the foreach
# kernel, whose step count stays on the CPU (capturable=True is refused there): the fake device sees its .item()
# as a sync.
SYNC_FREE = {"sgd", "adamw_fused", "sgd_plain"}
# Adafactor keeps its step count as a CPU tensor too (a sync on the fake device, as plain AdamW's).


def _make(opt_name: str, params, **options) -> AccoOptimizer:
    """The library's optimizer for ``opt_name`` over TinyNet's ``params``."""
    cls, kw = OPTIMIZERS[opt_name]
    if cls != "split":
        return AccoOptimizer(params, cls, **options, **kw)
    params = list(params)
    groups = [{"params": [params[i] for i in MATRICES], "optimizer_class": torch.optim.Muon, **kw["muon"]},
              {"params": [q for i, q in enumerate(params) if i not in MATRICES]}]
    return AccoOptimizer(groups, torch.optim.AdamW, **options, **kw["adamw"])


def _reference_opt(opt_name: str):
    """The oracle's optimizer over full tensors, for ``opt_name``."""
    cls, kw = OPTIMIZERS[opt_name]
    if cls != "split":
        return lambda ps: cls(ps, **kw)
    rest = [i for i in range(len(list(make_model().parameters()))) if i not in MATRICES]
    return lambda ps: Split(ps, [(torch.optim.Muon, list(MATRICES), kw["muon"]), (torch.optim.AdamW, rest, kw["adamw"])])


# (name, optimizer, mode, micro-batches per update, model's fake device, current fake device)
CONFIGS = [(f"{o}/{mode}", o, mode, 2, 0, 0) for o in ("sgd", "adamw") for mode in ("acco", "dpu", "sync")]
CONFIGS += [
    ("adamw_fused/acco", "adamw_fused", "acco", 2, 0, 0),
    ("sgd_plain/dpu", "sgd_plain", "dpu", 2, 0, 0),
    ("sgd/acco/m3", "sgd", "acco", 3, 0, 0),
    # model.to("cuda:1") without torch.cuda.set_device(1): events must be on the parameters' device
    ("sgd/acco/model-on-device-1", "sgd", "acco", 2, 1, 0),
    # accumulate_while_communicating with max_microbatches=1: a hand-off at every step(), the bound reached
    # each time, so the compute stream (not the host) waits for the round
    ("sgd/acco/accumulate-while-communicating", "sgd", "acco", None, 0, 0),
    ("adafactor/acco", "adafactor", "acco", 2, 0, 0),
    ("muon_split/acco", "muon_split", "acco", 2, 0, 0),
    ("muon_split/sync", "muon_split", "sync", 2, 0, 0),
    # the library's default estimate_dtype ("auto"): the estimate round in bf16 on more than one rank. The
    # others name the paper's exact estimate (estimate_dtype=None).
    ("adamw_fused/acco/estimate-auto", "adamw_fused", "acco", 2, 0, 0),
    ("sgd/acco/m3-estimate-auto", "sgd", "acco", 3, 0, 0),
    # a later estimate hand-off (estimate_microbatches=3 of 4): the commit hides behind 3 micro-batches
    ("adamw/acco/m4-estimate-after-3", "adamw", "acco", 4, 0, 0),
    # estimate_extrapolation=1.2: Muon's estimate extrapolated from its step on the snapshot, AdamW's computed
    ("muon_split/acco/extrapolate", "muon_split", "acco", 2, 0, 0),
    # delay_correction=1.0 (mode dpu's error feedback): Muon's whole tensors and AdamW's slices
    ("muon_split/dpu/delay-correction", "muon_split", "dpu", 2, 0, 0),
    # and fused AdamW, whose kernel would skip a flagged step by itself: the snapshot undoes step and feedback
    ("adamw_fused/dpu/delay-correction", "adamw_fused", "dpu", 2, 0, 0),
    # compressed rounds: the all-to-all, the residual kept under the device's undo flag, the weights' change
    # against the parameters, read on the side stream
    ("sgd/acco/int8", "sgd", "acco", 2, 0, 0),
    ("adamw_fused/dpu/fp8", "adamw_fused", "dpu", 2, 0, 0),
    ("sgd/sync/int8", "sgd", "sync", 2, 0, 0),
]
AUTO_WORLDS = (1, 2)  # compared with the oracle's bf16 sum where the ranks' bf16 sum has one order


def _estimate_option(name: str) -> dict:
    later = {"estimate_microbatches": 3} if name.endswith("estimate-after-3") else {}
    later.update({"estimate_extrapolation": 1.2} if name.endswith("extrapolate") else {})
    later.update({"delay_correction": 1.0} if name.endswith("delay-correction") else {})
    kind = name.rsplit("/", 1)[-1]
    later.update({"compression": kind, "compression_block": 16} if kind in ("int8", "fp8") else {})
    return {**later} if name.endswith("estimate-auto") else {"estimate_dtype": None, **later}
ELASTIC_STEPS = 6


def _train(name, opt_name, mode, m, model_device, current_device, rank):
    fake = FakeCuda(devices=2, model_device=model_device, current_device=current_device)
    acco.device_api.stream_api = lambda device: fake
    destroyed_after_end = []
    real_destroy = dist.destroy_process_group

    def destroy(group=None):  # finish(): the host must know that the last round has run before its group goes
        destroyed_after_end.append(all(fake.host_clock.get(s.name, 0) >= s.issued for s in fake.side_streams))
        real_destroy(group)

    dist.destroy_process_group = destroy
    try:
        with fake:
            model = make_model()
            theta0 = [p.detach().clone() for p in model.parameters()]
            if m is None:
                opt = _make(opt_name, model.parameters(), mode=mode, accumulate_while_communicating=True,
                            max_microbatches=1, **_estimate_option(name))
            else:
                opt = _make(opt_name, model.parameters(), mode=mode, microbatches_per_update=m, **_estimate_option(name))
            traj = []
            for t in range(UPDATES if m is not None else ELASTIC_STEPS):
                # until the first commit has run, the optimizer has no state to undo a skip with: the host decides
                first_commit_done = t >= (1 if m is not None else 2)
                with fake.forbid_syncs() if first_commit_done else contextlib.nullcontext():
                    for j in range(m or 1):
                        (loss_fn(model, rank, t * (m or 1) + j) / (m or 1)).backward()
                    opt.step()
                    opt.zero_grad()
                    traj.append(flat(model))  # a copy on the compute stream: needs the round's weights
                    if t == 1:  # NCCL's rule: the CUDA path issues rounds from the caller, no thread of its own
                        threads = [th.name for th in threading.enumerate() if th.name == "acco-round"]
            # Round records: timing events and the counts' host copies. Read mid-run in one configuration (their
            # events must be waited for); after finish() in the others, whose finish() must wait by itself.
            early = name == "sgd/acco"
            stats = opt.round_stats() if early else None
            with opt.committed_weights():
                committed = flat(model)
            opt.finish()
            stats = stats if early else opt.round_stats()
            final = flat(model)
    finally:
        acco.device_api.stream_api = acco.device_api.__dict__["_real_stream_api"]
        dist.destroy_process_group = real_destroy
    return dict(
        theta0=theta0, traj=traj, committed=committed, final=final, races=fake.races[:5],
        forbidden_syncs=fake.forbidden_syncs[:3], unrecorded=fake.unrecorded_side_storages()[:5],
        deferred=fake.deferred_ops, side_priority=[s.priority for s in fake.side_streams],
        side_devices=[s.device for s in fake.side_streams], destroyed_after_end=destroyed_after_end,
        uses_streams=opt.scheduler.uses_streams, rounds=opt.num_rounds, stats=stats, round_threads=threads,
        estimate_dtype=opt.estimate_dtype, estimate_microbatches=opt.estimate_microbatches,
        estimate_extrapolation=opt.estimate_extrapolation, delay_correction=opt.delay_correction,
        compression=opt.compression, compression_block=opt.compression_block,
    )


def _worker(rank: int, world: int) -> dict:
    os.environ["ACCO_RING"] = "0"  # native collectives, as on NCCL
    return {c[0]: _train(*c, rank) for c in CONFIGS if not c[0].endswith("estimate-auto") or world in AUTO_WORLDS}


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_ranks(_worker, world, timeout=600)


@pytest.mark.parametrize("world,name", [pytest.param(w, c[0], marks=() if w == 2 else pytest.mark.slow)
                                        for c in CONFIGS for w in (1, 2, 3)
                                        if not c[0].endswith("estimate-auto") or w in AUTO_WORLDS])
def test_cuda_path_matches_oracle_with_no_race(world, name):
    _, opt_name, mode, m, model_device, _ = next(c for c in CONFIGS if c[0] == name)
    make_opt, tol = _reference_opt(opt_name), TOL
    ref_steps, ref_committed, ref_final = None, None, None
    for rank, r in enumerate(_results(world)):
        r = r[name]
        assert r["uses_streams"], "the test must run the stream path"
        auto = name.endswith("estimate-auto") and world > 1  # "auto" is bf16 where there are bytes to save
        assert r["estimate_dtype"] == (torch.bfloat16 if auto else None), r["estimate_dtype"]
        assert r["round_threads"] == [], "no worker thread issues collectives on the CUDA path"
        assert r["deferred"] > 0, "the side stream must have deferred work, or nothing was simulated"
        assert r["races"] == [], f"rank {rank}: unordered accesses: {r['races']}"
        assert r["unrecorded"] == [], f"rank {rank}: round memory not record_stream-ed: {r['unrecorded']}"
        if opt_name in SYNC_FREE:
            assert r["forbidden_syncs"] == [], f"rank {rank}: host syncs in the loop: {r['forbidden_syncs']}"
        assert r["side_priority"] == [-1], "one side stream, at high priority"
        assert r["side_devices"] == [model_device], "the side stream lives on the parameters' device"
        assert r["destroyed_after_end"] and all(r["destroyed_after_end"]), "round group destroyed before its last round ran"
        stats = r["stats"]
        early = name == "sgd/acco"
        assert len(stats) == r["rounds"] - (mode != "sync" and early)  # collected rounds (mid-run: one in flight)
        assert all(s["round_s"] is not None and s["wait_s"] is not None for s in stats[:-1]), stats
        assert all(len(s["rank_microbatches"]) == world and sum(s["rank_microbatches"]) == s["total_microbatches"] > 0
                   for s in stats)
        if m is None:  # the accumulate-while-communicating loop: one micro-batch per hand-off on every rank
            steps, final = reference_run(r["theta0"], make_opt, mode, grad_fn,
                                         [[1] * ELASTIC_STEPS] * world)
            ref_steps, ref_final = steps[rank], final
        elif ref_steps is None:
            def scaled(rr, i, w):
                return [g / m for g in grad_fn(rr, i, w)]

            ref_steps, ref_committed, ref_final = update_run(r["theta0"], make_opt, mode, scaled,
                                                             world, UPDATES, m, estimate_dtype=r["estimate_dtype"],
                                                             estimate_microbatches=r["estimate_microbatches"],
                                                             estimate_extrapolation=r["estimate_extrapolation"],
                                                             delay_correction=r["delay_correction"],
                                                             compression=r["compression"],
                                                             compression_block=r["compression_block"])
        assert max(rel_err(a, flat_list(b)) for a, b in zip(r["traj"], ref_steps)) < tol, f"rank {rank}"
        if m is not None:
            assert rel_err(r["committed"], flat_list(ref_committed[-1])) < tol, f"rank {rank}"
        assert rel_err(r["final"], flat_list(ref_final)) < tol, f"rank {rank}"
        assert (r["final"] - flat_list(r["theta0"])).abs().max() > 1e-3, "the weights must move"


def test_device_without_index_is_resolved_at_construction():
    """``torch.device("cuda")``: the scheduler fixes the current device's index once (no set_device later)."""
    fake = FakeCuda(devices=2, current_device=1)
    with fake:
        sched = StreamScheduler(torch.device("cuda"), api=fake)
    assert sched.device == torch.device("cuda", 1)
    assert sched.side_stream.device == 1


def _faulty_run(rank, nonfinite, path, inject, completion_seed=None, updates=6, estimate_dtype=None):
    """Six updates of SGD with momentum in mode acco, 4 micro-batches each; ``inject``: an inf loss on rank 0
    in update 2, a learning rate changed on rank 1 only from update 2, or (``"short"``) one micro-batch only
    on rank 1 in update 2 (no estimate there: the ranks hand off different rounds from then on).
    ``completion_seed``: the simulated device completes side-stream work at random moments of its own.
    ``estimate_dtype``: None (the estimate and the commit send equal collectives, which a round mismatch found
    on the device needs: docs/gpu.md) or the library's default, ``"auto"``."""
    from acco import HyperParameterMismatchError, NonFiniteGradientError, RoundMismatchError

    fake = FakeCuda(completion_seed=completion_seed) if path == "stream" else None
    if fake is not None:
        acco.device_api.stream_api = lambda device: fake
    raised_at, error = None, None
    try:
        with fake if fake is not None else contextlib.nullcontext():
            model = make_model()
            opt = AccoOptimizer(model.parameters(), torch.optim.SGD, mode="acco", microbatches_per_update=4,
                                nonfinite=nonfinite, lr=5e-2, momentum=0.9, estimate_dtype=estimate_dtype)
            t = 0
            try:
                for t in range(updates):
                    m = 1 if inject == "short" and (t, rank) == (2, 1) else 4
                    for j in range(m):
                        loss = loss_fn(model, rank, 4 * t + j) / 4
                        if inject == "inf" and (t, j, rank) == (2, 3, 0):
                            loss = loss * float("inf")
                        loss.backward()
                    if inject == "lr" and t == 2 and rank == 1:
                        opt.param_groups[0]["lr"] = 0.1
                    opt.step()
                    opt.zero_grad()
                opt.finish()
            except (NonFiniteGradientError, HyperParameterMismatchError, RoundMismatchError) as exc:
                raised_at, error = t, type(exc).__name__
            final = flat(model)
            master = opt.runtime.flat.shard.master.clone()
    finally:
        acco.device_api.stream_api = acco.device_api.__dict__["_real_stream_api"]
    return dict(final=final, master=master, skipped=opt.num_skipped_updates, raised_at=raised_at, error=error,
                races=fake.races[:3] if fake is not None else [], host_waits=opt.scheduler.host_waits)


def _fault_worker(rank: int, world: int) -> dict:
    os.environ["ACCO_RING"] = "0"
    return {
        "skip/stream": _faulty_run(rank, "skip", "stream", "inf"),
        "skip/cpu": _faulty_run(rank, "skip", "cpu", "inf"),
        "raise/stream": _faulty_run(rank, "raise", "stream", "inf"),
        "hyper/stream": _faulty_run(rank, "skip", "stream", "lr"),
        # the default bf16 estimate: found on the device too (the collectives' sizes agree), and on the host
        "raise/stream-auto": _faulty_run(rank, "raise", "stream", "inf", estimate_dtype="auto"),
        "short/cpu-auto": _faulty_run(rank, "skip", "cpu", "short", estimate_dtype="auto"),
    }


@functools.lru_cache(maxsize=None)
def _fault_results():
    return run_ranks(_fault_worker, 2, timeout=600)


def test_nonfinite_skip_is_decided_on_the_device_like_on_cpu():
    """A non-finite commit is undone on the device (torch.where over the snapshot): the same run as the
    CPU path's host decision, and counted once the report is read."""
    for rank, r in enumerate(_fault_results()):
        stream, cpu = r["skip/stream"], r["skip/cpu"]
        assert stream["error"] is None and cpu["error"] is None
        assert stream["skipped"] == cpu["skipped"] == 1, (stream["skipped"], cpu["skipped"])
        assert torch.isfinite(stream["final"]).all()
        assert rel_err(stream["final"], cpu["final"]) < 1e-12, f"rank {rank}"
        assert stream["races"] == []


@pytest.mark.parametrize("case,error", [("raise/stream", "NonFiniteGradientError"),
                                        ("hyper/stream", "HyperParameterMismatchError"),
                                        ("raise/stream-auto", "NonFiniteGradientError")])
def test_device_decided_errors_surface_at_a_later_step_on_every_rank(case, error):
    """nonfinite='raise' and mismatched hyper-parameters, found on the device, raise two hand-offs later
    (or at finish()) on every rank, with the flagged step undone on the device."""
    results = [r[case] for r in _fault_results()]
    assert [r["error"] for r in results] == [error, error]
    assert all(torch.isfinite(r["final"]).all() for r in results), "the bad step must have been undone on the device"
    assert results[0]["raised_at"] == results[1]["raised_at"] >= 2
    assert all(r["races"] == [] for r in results)


SEEDS = range(4)


def _random_completion_worker(rank: int, world: int) -> dict:
    os.environ["ACCO_RING"] = "0"
    out = {}
    for seed in SEEDS:
        for case, (nonfinite, inject) in {"raise": ("raise", "inf"), "hyper": ("skip", "lr"),
                                          "short": ("skip", "short")}.items():
            out[case, seed] = _faulty_run(rank, nonfinite, "stream", inject, completion_seed=100 * seed + rank)
    out["clean"] = _faulty_run(rank, "skip", "stream", None, updates=2)
    return out


@functools.lru_cache(maxsize=None)
def _random_completion_results():
    return run_ranks(_random_completion_worker, 2, timeout=600)


@pytest.mark.parametrize("case,error", [("raise", "NonFiniteGradientError"), ("hyper", "HyperParameterMismatchError"),
                                        ("short", "RoundMismatchError")])
def test_device_found_errors_surface_at_the_same_step_when_ranks_disagree_on_what_is_done(case, error):
    """Side streams complete at rank-dependent random moments (FakeCuda's completion_seed, a different seed
    per rank): every rank still raises the device-found error in the same update, because the report of
    round k-2 is read at hand-off k, a point of the program, not when query() happens to say done."""
    results = _random_completion_results()
    for seed in SEEDS:
        r0, r1 = results[0][case, seed], results[1][case, seed]
        assert r0["error"] == r1["error"] == error, (seed, r0["error"], r1["error"])
        assert r0["raised_at"] == r1["raised_at"], f"seed {seed}: rank 0 raised in update {r0['raised_at']}, " \
                                                  f"rank 1 in {r1['raised_at']}"
        assert r0["races"] == r1["races"] == []


def test_the_default_bf16_estimate_finds_ranks_out_of_step_on_the_host_before_its_smaller_collectives():
    """With the bf16 estimate an estimate round sends fewer bytes than a commit. On the CPU path the ranks' round
    rows are checked on the host before the reduce-scatter, so ranks that hand off different rounds (one ran a
    short update) raise RoundMismatchError in the same update instead of sending collectives of different sizes."""
    results = [r["short/cpu-auto"] for r in _fault_results()]
    assert [r["error"] for r in results] == ["RoundMismatchError"] * 2, [r["error"] for r in results]
    assert results[0]["raised_at"] == results[1]["raised_at"] == 2
    assert all(torch.isfinite(r["final"]).all() for r in results)


def test_mismatched_rounds_are_undone_on_the_device():
    """Ranks that hand off different rounds (one ran a short update) must not combine their shards: every
    flagged round is undone on the device, so the master after the error is the one after the last good
    update (a clean run of the two updates before the mismatch)."""
    results = _random_completion_results()
    for rank in range(2):
        clean = results[rank]["clean"]["master"]
        for seed in SEEDS:
            r = results[rank]["short", seed]
            assert torch.isfinite(r["final"]).all()
            assert torch.equal(r["master"], clean), f"rank {rank}, seed {seed}: a mismatched round changed theta"


def test_round_group_is_connected_in_the_constructor():
    """NCCL connects a communicator at its first collective: the round group's must come from the
    constructor (the training thread), not from the first estimate's hand-off inside backward()."""
    results = run_ranks(_connect_worker, 2, timeout=120)
    for r in results:
        assert r["at_construction"] >= 1, "the constructor issued no collective on the round group"


def _connect_worker(rank: int, world: int) -> dict:
    os.environ["ACCO_RING"] = "0"
    fake = FakeCuda()
    acco.device_api.stream_api = lambda device: fake
    try:
        with fake:
            model = make_model()
            opt = AccoOptimizer(model.parameters(), torch.optim.SGD, microbatches_per_update=2, lr=5e-2)
            name = opt.runtime.driver.ctx.group.group_name

            def on_round_group():
                return sum(1 for _, pg in fake.collectives if pg is not None and
                           dist.ProcessGroup.unbox(pg).group_name == name)

            at_construction = on_round_group()
            (loss_fn(model, rank, 0) / 2).backward()  # the first half: the estimate's hand-off issues a round
            assert on_round_group() > at_construction, "the name must match the rounds' group"
            opt.finish()
    finally:
        acco.device_api.stream_api = acco.device_api.__dict__["_real_stream_api"]
    return dict(at_construction=at_construction)


def test_finish_waits_on_the_host_for_the_last_round():
    """One process, a round in flight at finish(), nothing else synchronising: finish() itself must make the
    host wait for the last round (its report is read, then its communicator may go)."""
    fake = FakeCuda()
    acco.device_api.stream_api = lambda device: fake
    try:
        with fake:
            model = make_model()
            opt = AccoOptimizer(model.parameters(), torch.optim.SGD, mode="acco", microbatches_per_update=2, lr=5e-2)
            for t in range(3):
                for j in range(2):
                    (loss_fn(model, 0, 2 * t + j) / 2).backward()
                opt.step()
            side = fake.side_streams[0]
            assert fake.host_clock.get(side.name, 0) < side.issued, "a round must be in flight for this test"
            opt.finish()
            assert fake.host_clock.get(side.name, 0) >= side.issued, "finish() returned before the last round ran"
    finally:
        acco.device_api.stream_api = acco.device_api.__dict__["_real_stream_api"]
    assert fake.races == []


def test_synchronize_makes_the_host_wait_for_the_last_round():
    """StreamScheduler.synchronize() itself blocks the host until the last round issued has run (close() and
    read_reports() rely on it where no report is left to wait on: finish()'s own report reads wait on every
    round's end event, so the test above cannot tell a synchronize() that does nothing)."""
    fake = FakeCuda()
    with fake:
        sched = StreamScheduler(torch.device("cuda"), api=fake)
        x = torch.zeros(4)
        sched.submit(lambda: x.add_(1.0), uses=[x])
        sched.wait()
        side = sched.side_stream
        assert fake.host_clock.get(side.name, 0) < side.issued, "the round must still be in flight for this test"
        sched.synchronize()
        assert fake.host_clock.get(side.name, 0) >= side.issued, "synchronize() returned before the round ran"
        sched.close(wait=False, join_timeout=0.0)


def _fused_skip_run(path: str, in_kernel: bool = True, **options):
    """One process, fused AdamW in mode acco (or ``options``), an inf loss in update 2 (skipped); returns the
    final weights, the skip count and memory_report()."""
    import acco.rounds

    fake = FakeCuda() if path == "stream" else None
    if fake is not None:
        acco.device_api.stream_api = lambda device: fake
    real = acco.rounds.skips_in_kernel
    if not in_kernel:
        acco.rounds.skips_in_kernel = lambda optimizer: False  # the snapshot path, for comparison
    try:
        with fake if fake is not None else contextlib.nullcontext():
            model = make_model()
            opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, microbatches_per_update=2, lr=1e-2,
                                fused=True, **options)
            for t in range(5):
                for j in range(2):
                    loss = loss_fn(model, 0, 2 * t + j) / 2
                    (loss * float("inf") if (t, j) == (2, 1) else loss).backward()
                opt.step()
                opt.zero_grad()
            report = opt.memory_report()
            opt.finish()
            final = flat(model)
    finally:
        acco.device_api.stream_api = acco.device_api.__dict__["_real_stream_api"]
        acco.rounds.skips_in_kernel = real
    return dict(final=final, skipped=opt.num_skipped_updates, report=report,
                races=fake.races[:3] if fake is not None else [])


def test_fused_adamw_skips_in_its_kernel_without_a_snapshot():
    """Fused AdamW on the CUDA path: a non-finite commit is skipped by the fused kernel itself (found_inf),
    giving the CPU path's run, and no snapshot is allocated (the snapshot path holds 12 Phi/N bytes)."""
    stream, cpu, snap = _fused_skip_run("stream"), _fused_skip_run("cpu"), _fused_skip_run("stream", in_kernel=False)
    print(f"memory_report()['estimate_scratch']: {snap['report']['estimate_scratch']} bytes with the snapshot, "
          f"{stream['report']['estimate_scratch']} skipping in the kernel")
    assert stream["skipped"] == cpu["skipped"] == snap["skipped"] == 1
    assert rel_err(stream["final"], cpu["final"]) < 1e-12 and rel_err(snap["final"], cpu["final"]) < 1e-12
    assert stream["report"]["estimate_scratch"] == 0
    assert snap["report"]["estimate_scratch"] >= 3 * stream["report"]["master"]  # master, exp_avg, exp_avg_sq, steps
    assert stream["races"] == [] and snap["races"] == []


def test_a_skipped_step_takes_its_delay_correction_with_it():
    """Mode dpu with delay_correction: a non-finite commit flagged on the device is undone with its error feedback
    (from the snapshot: the fused kernel's own skip would leave the feedback applied), giving the CPU path's run,
    where the host skips both."""
    options = dict(mode="dpu", delay_correction=1.0)
    stream, cpu = _fused_skip_run("stream", **options), _fused_skip_run("cpu", **options)
    assert stream["skipped"] == cpu["skipped"] == 1
    assert rel_err(stream["final"], cpu["final"]) < 1e-12, rel_err(stream["final"], cpu["final"])
    assert stream["report"]["estimate_scratch"] > 0  # the snapshot, and the copy of the slice the feedback takes
    assert stream["races"] == []


def test_record_stream_leaves_host_tensors_alone():
    """Check the CUDA API's record_stream skips host tensors (torch has no record_stream for them). Found on the
    first GPU run: Adafactor keeps its step counter on the host, and the round's list of tensors the side
    stream uses included it, so every Adafactor round on CUDA raised NotImplementedError."""
    from acco.device_api import CudaStreams

    CudaStreams.record_stream(torch.zeros(()), torch.Stream("cpu"))  # raised before the fix
