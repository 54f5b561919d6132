"""``compression="auto"`` (``auto.py``, ``docs/compression.md``): the choice from a measured link, the switch
between updates against the oracle, the choice agreed across ranks and kept in checkpoints, and what it
refuses."""

from __future__ import annotations

import functools
import logging
import time

import pytest
import torch

from _dist import run_ranks
from oracle import update_run
from tinynet import flat, flat_list, grad_fn, loss_fn, make_model, rel_err

import acco.auto as auto
from acco import AccoOptimizer
from acco.modes import Mode

KW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
UPDATES = 6
SIZES = {"none": (480, 960), "int8": (260, 260), "int4": (140, 140)}  # bf16 estimate, fp32 commit; packed


# ---------------------------------------------------------------- the choice (pure)


def _measured(x: float, compute: float = 1.0, latency: float = 0.0) -> auto.Measurement:
    """An uncompressed run whose exact round lasts ``x`` halves of an update's compute, ``latency`` of it fixed."""
    commit = x * compute / 2
    link = commit - latency
    return auto.Measurement(compute, latency + link / 2, commit)  # the bf16 estimate: half the link's bytes


@pytest.mark.parametrize("x,expected", [(0.3, "none"), (1.0, "none"), (1.3, "int8"), (2.0, "int8"),
                                        (3.0, "int4"), (6.0, "int4"), (12.0, "int4")])
def test_auto_takes_the_fewest_bits_that_hide_the_round(x, expected):
    """The rounds' bytes: int8 0.27 and int4 0.15 of the exact commit's. With the margin (a compressed round
    counted 1/0.7 longer), int8 hides up to x = 2.6 and int4 up to 4.8; beyond, the fastest: int4."""
    kind, predicted = auto.choose(_measured(x), Mode.ACCO, 0.5, SIZES)
    assert kind == expected, (x, predicted)
    assert predicted[kind] <= predicted["none"]


def test_the_quantizers_time_counts_in_a_compressed_round():
    """At x = 2, int8 hides by its bytes; a quantizer as slow as a quarter of the compute does not let it."""
    fast = auto.Measurement(1.0, 0.5, 1.0, (("int8", 0.0), ("int4", 0.0)))
    slow = auto.Measurement(1.0, 0.5, 1.0, (("int8", 0.25), ("int4", 0.05)))
    assert auto.choose(fast, Mode.ACCO, 0.5, SIZES)[0] == "int8"
    assert auto.choose(slow, Mode.ACCO, 0.5, SIZES)[0] == "int4"


def test_a_round_of_latency_keeps_the_rounds_uncompressed():
    """Rounds that take as long whatever their bytes (latency, not the link): fewer bytes save nothing."""
    kind, predicted = auto.choose(_measured(6.0, latency=2.9), Mode.ACCO, 0.5, SIZES)
    assert kind == "none", predicted
    fixed, per_byte = auto.fit_round([(960, 3.0), (480, 2.95)])
    assert fixed == pytest.approx(2.9) and per_byte == pytest.approx(0.05 / 480)


def test_a_saving_too_small_to_matter_keeps_the_rounds_uncompressed():
    tiny = auto.Measurement(0.0004, 0.0005, 0.001)  # 1 ms rounds: compression would save under 2 ms
    assert auto.choose(tiny, Mode.ACCO, 0.5, SIZES)[0] == "none"


def test_the_update_time_model_of_each_mode():
    assert auto.predict_update(Mode.ACCO, 1.0, 0.5, 0.2, 0.8) == pytest.approx(0.8 + 0.5)
    assert auto.predict_update(Mode.ACCO, 1.0, 0.25, 0.9, 0.1) == pytest.approx(0.25 + 0.9)
    assert auto.predict_update(Mode.DPU, 1.0, 0.5, 0.0, 1.5) == pytest.approx(1.5)
    assert auto.predict_update(Mode.SYNC, 1.0, 0.5, 0.0, 0.5) == pytest.approx(1.5)
    # mode sync hides nothing: any saving of bytes counts
    assert auto.choose(_measured(1.0), Mode.SYNC, 0.5, SIZES)[0] != "none"


def test_the_candidates_and_their_bytes():
    assert auto.candidates() == ["none", "int8", "int4"]
    numel, shard = 1 << 20, 1 << 19
    e, c = auto.wire_bytes("none", numel, shard, 2, 256, True, torch.float32, torch.float32, torch.bfloat16)
    assert (e, c) == (4 * numel, 8 * numel)
    e8, c8 = auto.wire_bytes("int8", numel, shard, 2, 256, True, torch.float32, torch.float32, None)
    e4, _ = auto.wire_bytes("int4", numel, shard, 2, 256, True, torch.float32, torch.float32, None)
    assert e8 == c8 and c8 / c == pytest.approx((1 + 4 / 256) / 4)
    assert e4 / e8 == pytest.approx((0.5 + 4 / 256) / (1 + 4 / 256))
    exact_weights = auto.wire_bytes("int8", numel, shard, 2, 256, False, torch.float32, torch.float32, None)[1]
    assert exact_weights == c8 / 2 + 4 * numel


# ---------------------------------------------------------------- the switch, against the oracle


def _train(opt, model, rank, updates, m=2, start=0, slow=0.0):
    traj = []
    for t in range(start, updates):
        for j in range(m):
            if slow:
                time.sleep(slow)  # compute that takes time (the tiny model's takes none)
            (loss_fn(model, rank, t * m + j) / m).backward()
        opt.step()
        opt.zero_grad()
        traj.append(flat(model))
    return traj


def _forced(kind):
    def choose(measured, mode, share, sizes):
        return kind, {k: 0.0 for k in sizes}
    return choose


def _switch_worker(rank: int, world: int) -> dict:
    out = {}
    for mode in ("acco", "dpu", "sync"):
        auto.choose = _forced("int8")
        model = make_model()
        theta0 = [p.detach().clone() for p in model.parameters()]
        opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, mode=mode, compression="auto",
                            compression_block=16, microbatches_per_update=2, estimate_extrapolation=1.0, **KW)
        traj = _train(opt, model, rank, UPDATES)
        opt.finish()
        estimate_dtype = torch.bfloat16 if mode == "acco" else None
        ref, _, final = update_run(theta0, lambda ps: torch.optim.AdamW(ps, **KW), mode,
                                   lambda r, i, w: [g / 2 for g in grad_fn(r, i, w)], world, UPDATES, 2,
                                   estimate_dtype=estimate_dtype, compression="int8", compression_block=16,
                                   compression_from=auto.WARMUP_UPDATES + auto.WINDOW_UPDATES)
        never = update_run(theta0, lambda ps: torch.optim.AdamW(ps, **KW), mode,
                           lambda r, i, w: [g / 2 for g in grad_fn(r, i, w)], world, UPDATES, 2,
                           estimate_dtype=estimate_dtype)[2]
        out[mode] = {"step_err": max(rel_err(a, flat_list(b)) for a, b in zip(traj, ref)),
                     "final_err": rel_err(flat(model), flat_list(final)),
                     "vs_uncompressed": rel_err(flat(model), flat_list(never)),
                     "residual": opt.memory_report()["residual"]}
    return out


@functools.lru_cache(maxsize=None)
def _switch_results():
    return run_ranks(_switch_worker, 2, timeout=240)


@pytest.mark.parametrize("mode", ["acco", "dpu", "sync"])
def test_the_switch_equals_the_oracle_compressing_from_that_update(mode):
    """Forced to int8, an auto run equals the oracle's run that is uncompressed (the bf16 estimate in mode acco)
    for the window's updates and int8 from a zero residual after them, within 1e-5, in every mode; and it is not
    the uncompressed run (the switch happened)."""
    for rank, results in enumerate(_switch_results()):
        r = results[mode]
        assert r["step_err"] < 1e-5 and r["final_err"] < 1e-5, (rank, mode, r)
        assert r["vs_uncompressed"] > 1e-4, (rank, mode, r)
        assert r["residual"] > 0, r


# ---------------------------------------------------------------- measured on a simulated link


def _slow_link(seconds_per_byte: float):
    """Every collective of a round sleeps for its bytes (a link of that speed, in the round's thread)."""
    import acco.compressed as compressed
    import acco.transport as transport

    def slowed(fn, nbytes):
        def wrapper(*args, **kwargs):
            time.sleep(seconds_per_byte * nbytes(args))
            return fn(*args, **kwargs)
        return wrapper

    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    transport.reduce_scatter_flat = slowed(transport.reduce_scatter_flat, lambda a: size(a[1]))
    transport.all_gather_flat = slowed(transport.all_gather_flat, lambda a: size(a[0]))
    compressed.all_gather_flat = slowed(compressed.all_gather_flat, lambda a: size(a[0]))
    original = compressed.dist.all_to_all_single

    class _Dist:
        def __getattr__(self, name):
            return getattr(torch.distributed, name)

        @staticmethod
        def all_to_all_single(out, inp, **kw):
            time.sleep(seconds_per_byte * size(inp))
            return original(out, inp, **kw)

    compressed.dist = _Dist()


def _measured_worker(rank: int, world: int, seconds_per_byte: float) -> dict:
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger("acco").addHandler(handler)
    logging.getLogger("acco").setLevel(logging.INFO)
    if seconds_per_byte:
        _slow_link(seconds_per_byte)
    model = make_model()
    opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, compression="auto", microbatches_per_update=2, **KW)
    _train(opt, model, rank, 5, slow=0.08)
    a = opt._runtime.auto
    opt.finish()
    m = a.measured
    return {"decided": a.decided, "measured": None if m is None else (m.compute_s, m.estimate_s, m.commit_s),
            "predicted": a.predicted,
            "log": [r for r in records if "compression='auto'" in r],
            "transport": type(opt._runtime.flat.transport).__name__}


@pytest.mark.parametrize("seconds_per_byte,expected", [(0.0, "none"), (2.35e-4, "int8"), (6e-4, "int4")])
def test_auto_measures_the_link_and_chooses(seconds_per_byte, expected):
    """Compute of 80 ms per micro-batch; a link with no delay, then one whose exact round lasts about 1.6 and 3.8
    halves of an update (the tiny model's round has about 15 ms of its own): none, int8 and int4, the same on
    both ranks, logged on both."""
    results = run_ranks(_measured_worker, 2, seconds_per_byte, timeout=120)
    for rank, r in enumerate(results):
        assert r["decided"] == expected, (rank, r)
        assert r["measured"] == results[0]["measured"], "the ranks decide from the same figures"
        assert len(r["log"]) == 1 and f"chose {expected}" in r["log"][0], r["log"]
        assert r["transport"] == ("Quantized" if expected != "none" else "NarrowEstimate")


def _shards_worker(rank: int, world: int) -> dict:
    """FSDP2 inside a host (mesh['tp']), ACCO across hosts (mesh['dp']): two replica groups, one per shard. Each
    measures its own window; here the second's compute is made ten times the first's."""
    import dataclasses

    from test_mesh import MLP
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    seen = []

    def choose(measured, mode, share, sizes):
        seen.append(measured)
        return ("int8" if measured.compute_s > 0.5 else "none"), {k: 0.0 for k in sizes}

    auto.choose = choose
    torch.manual_seed(0)
    model = MLP()
    fully_shard(model, mesh=mesh["tp"])
    opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, microbatches_per_update=2, compression="auto",
                        compression_block=4, process_group=mesh["dp"], **KW)
    driver = opt._runtime.driver
    measure = driver.measure_updates
    shard = mesh.get_local_rank("tp")
    driver.measure_updates = lambda a, b: dataclasses.replace(measure(a, b), compute_s=1.0 if shard else 0.1)
    for t in range(5):
        for j in range(2):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * rank + 10 * t + j))
            (model(x).square().mean() / 2).backward()
        opt.step()
        opt.zero_grad()
    opt.finish()
    return {"decided": opt._runtime.auto.decided, "in_use": opt.compression_in_use,
            "compute": [m.compute_s for m in seen]}


def test_the_replica_groups_of_every_shard_decide_as_one():
    """With FSDP2 inside a host each shard's replicas form a rounds group of their own, and each measures its
    own window. They decide from the slowest figures over all of them (an exchange on the model group), so
    every rank runs the same format: here int8 everywhere, though the first shard's own figures say none."""
    results = run_ranks(_shards_worker, 4, timeout=120)
    for rank, r in enumerate(results):
        assert r["decided"] == "int8" and r["in_use"] == "int8", (rank, r)
        assert r["compute"] == [1.0], (rank, r)


# ---------------------------------------------------------------- checkpoints


def _resume_worker(rank: int, world: int) -> dict:
    auto.choose = _forced("int8")
    make = lambda model: AccoOptimizer(model.parameters(), torch.optim.AdamW, compression="auto",  # noqa: E731
                                       compression_block=16, microbatches_per_update=2, **KW)
    out = {}
    for save_after in (5, 2):  # after the choice, and before it
        model = make_model()
        opt = make(model)
        straight = _train(opt, model, rank, 8)
        opt.finish()
        model = make_model()
        opt = make(model)
        _train(opt, model, rank, save_after)
        sd = opt.state_dict()
        saved_residual = opt._runtime.flat.transport.residual
        saved_residual = None if saved_residual is None else saved_residual.clone()
        opt.finish()
        model = make_model(seed=7)  # another model: the load restores the weights
        opt = make(model)
        opt.load_state_dict(sd, restore_model=True)
        a = opt._runtime.auto
        residual = opt._runtime.flat.transport.residual
        at_load = (a.decided, type(opt._runtime.flat.transport).__name__,
                   None if residual is None else residual.clone())
        resumed = _train(opt, model, rank, 8, start=save_after)
        opt.finish()
        out[save_after] = {
            "err": max(rel_err(a_, b_) for a_, b_ in zip(resumed, straight[save_after:])),
            "decided_at_load": at_load[0], "transport_at_load": at_load[1],
            "residual_kept": None if saved_residual is None else bool(torch.equal(at_load[2], saved_residual)),
            "decided_at_end": a.decided, "decide_at": a.decide_at, "described": sd["acco"]["auto"]}
    return out


def test_a_resumed_auto_run_takes_the_saved_choice_or_measures_anew():
    """Saved after the choice: the load takes it (the format and the residual at once) and the run goes on bit
    for bit as the straight one. Saved before it: the load keeps the rounds uncompressed and decides after a
    warm-up and a window of its own (the window the straight run measured was cut by the save)."""
    for rank, results in enumerate(run_ranks(_resume_worker, 2, timeout=240)):
        after, before = results[5], results[2]
        assert after["err"] == 0.0, (rank, after)
        assert (after["decided_at_load"], after["transport_at_load"], after["residual_kept"]) == \
            ("int8", "Quantized", True), after
        assert after["described"] == "int8"
        assert before["described"] == "undecided" and before["decided_at_load"] is None, before
        assert before["transport_at_load"] == "NarrowEstimate" and before["decided_at_end"] == "int8", before
        assert before["decide_at"] == 2 + auto.WARMUP_UPDATES + auto.WINDOW_UPDATES, before


# ---------------------------------------------------------------- refusals


def test_auto_refuses_the_loop_that_sets_its_micro_batches_by_the_round():
    model = make_model()
    with pytest.raises(ValueError, match="compression='auto' with accumulate_while_communicating=True"):
        AccoOptimizer(model.parameters(), compression="auto", accumulate_while_communicating=True)


def test_auto_refuses_a_reduce_dtype_it_would_keep_after_the_switch():
    model = make_model()
    with pytest.raises(ValueError, match="reduce_dtype=torch.bfloat16 with compression='auto'.*Drop reduce_dtype"):
        AccoOptimizer(model.parameters(), compression="auto", reduce_dtype=torch.bfloat16)


def _failing_worker(rank: int, world: int) -> str:
    from acco.driver import RoundDriver

    if rank == 1:
        def broken(self, first, last):
            raise RuntimeError("no clock here")
        RoundDriver.measure_updates = broken
    model = make_model()
    opt = AccoOptimizer(model.parameters(), compression="auto", microbatches_per_update=2, **KW)
    try:
        _train(opt, model, rank, UPDATES)
    except RuntimeError as exc:
        return str(exc)
    return "trained"


def test_a_rank_that_cannot_measure_makes_every_rank_raise_not_wait():
    for rank, said in enumerate(run_ranks(_failing_worker, 2, timeout=120)):
        assert "compression='auto' could not measure its window on rank(s) [1]" in said, (rank, said)


def test_an_unknown_compression_names_auto_among_the_choices():
    model = make_model()
    with pytest.raises(ValueError, match="'int8', 'fp8', 'int4' or 'auto'.*got 'int2'"):
        AccoOptimizer(model.parameters(), compression="int2")


# ---------------------------------------------------------------- the CUDA path, on the simulated device


def _fake_cuda_worker(rank: int, world: int) -> dict:
    import contextlib
    import os

    import acco.device_api
    from fake_cuda import FakeCuda

    os.environ["ACCO_RING"] = "0"  # native collectives, as on NCCL
    auto.choose = _forced("int8")
    sgd = dict(lr=5e-2, momentum=0.9, weight_decay=0.01)
    fake = FakeCuda(devices=1)
    acco.device_api.stream_api = lambda device: fake
    decision = auto.WARMUP_UPDATES + auto.WINDOW_UPDATES  # the update whose first hand-off decides
    try:
        with fake:
            model = make_model()
            theta0 = [p.detach().clone() for p in model.parameters()]
            opt = AccoOptimizer(model.parameters(), torch.optim.SGD, compression="auto", compression_block=16,
                                microbatches_per_update=2, estimate_extrapolation=1.0, **sgd)
            traj = []
            for t in range(UPDATES):
                # the host reads the window's stamps once, at the decision; no other update waits for the device
                with fake.forbid_syncs() if t >= 1 and t != decision else contextlib.nullcontext():
                    traj += _train(opt, model, rank, t + 1, start=t)
            opt.finish()
            chose = opt.compression_in_use
    finally:
        acco.device_api.stream_api = acco.device_api.__dict__["_real_stream_api"]
    ref = update_run(theta0, lambda ps: torch.optim.SGD(ps, **sgd), "acco",
                     lambda r, i, w: [g / 2 for g in grad_fn(r, i, w)], world, UPDATES, 2,
                     estimate_dtype=torch.bfloat16, compression="int8", compression_block=16,
                     compression_from=decision)[0]
    return {"err": max(rel_err(a, flat_list(b)) for a, b in zip(traj, ref)), "races": fake.races[:5],
            "forbidden_syncs": fake.forbidden_syncs[:3], "unrecorded": fake.unrecorded_side_storages()[:5],
            "chose": chose}


def test_the_switch_on_the_cuda_path_is_race_free_and_waits_for_the_device_once():
    """On the simulated device (``tests/fake_cuda.py``, 2 gloo ranks): the switch to int8 equals the oracle,
    no stream reads what another writes unordered, the new transport's buffers are recorded on the side stream,
    and the host waits for the device only at the update that decides."""
    for rank, r in enumerate(run_ranks(_fake_cuda_worker, 2, timeout=240)):
        assert r["err"] < 1e-5, (rank, r)
        assert r["races"] == [] and r["forbidden_syncs"] == [] and r["unrecorded"] == [], r
        assert r["chose"] == "int8"
