"""Across regions (``outer_every``): 2 regions x 2 ranks (4 gloo ranks), every mode against the oracle's
transcription of ``docs/algorithm.md`` ("Across regions", ``tests/oracle.py::regions_run``).

Each region is a ``process_group`` of 2 ranks running the rounds; ``outer_group`` joins rank ``i`` of each region.
The regions see different data (global rank ``2r + i`` draws its own micro-batches), so their weights part between
outer rounds and the outer step has something to average. One spawn runs every configuration.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from oracle import regions_run, update_run
from tinynet import flat, flat_list, grad_fn, loss_fn, make_model, rel_err

import acco.checkpoint
from acco import AccoOptimizer

TOL = 1e-5
UPDATES = 7
REGIONS, PER_REGION = 2, 2
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9)),
}
# (name, optimizer, mode, micro-batches per update, outer options, the region's own options)
CONFIGS = [
    ("adamw/acco/every2", "adamw", "acco", 2, dict(outer_every=2), {}),
    ("adamw/sync/every3", "adamw", "sync", 2, dict(outer_every=3), {}),
    ("sgd/dpu/every2", "sgd", "dpu", 2, dict(outer_every=2), {}),
    ("adamw/acco/every3-delay1", "adamw", "acco", 2, dict(outer_every=3, outer_delay=1), {}),
    ("sgd/sync/every3-delay2", "sgd", "sync", 2, dict(outer_every=3, outer_delay=2), {}),
    # averaging the regions' weights (DiLoCo with an outer SGD of lr 1, no momentum)
    ("adamw/acco/every2-average", "adamw", "acco", 2, dict(outer_every=2, outer_lr=1.0, outer_momentum=0.0), {}),
    # the pseudo-gradient quantized with error feedback, blocks of 16
    ("adamw/acco/every2-int8", "adamw", "acco", 2, dict(outer_every=2, outer_compression="int8"),
     {"compression_block": 16}),
    ("sgd/sync/every2-delay1-int4", "sgd", "sync", 2, dict(outer_every=2, outer_delay=1, outer_compression="int4"),
     {"compression_block": 16}),
    # with the region's own rounds compressed too
    ("adamw/acco/every2-int8-inside-int8", "adamw", "acco", 2, dict(outer_every=2, outer_compression="int8"),
     {"compression": "int8", "compression_block": 16}),
    ("sgd/acco/every3-delay2-int4-inside-int8", "sgd", "acco", 2,
     dict(outer_every=3, outer_delay=2, outer_compression="int4"), {"compression": "int8", "compression_block": 16}),
    # a synchronous warm-up and clipping; mode dpu's error feedback
    ("adamw/acco/every2-sync2-clip", "adamw", "acco", 2, dict(outer_every=2),
     {"synchronous_updates": 2, "max_grad_norm": 0.05}),
    ("sgd/dpu/every3-delay1-correction", "sgd", "dpu", 2, dict(outer_every=3, outer_delay=1), {"delay_correction": 1.0}),
    # each rank's loss normalized over every region's ranks' batch, summed (torchtitan's): the region's mean again
    ("sgd/acco/every2-summed", "sgd", "acco", 2, dict(outer_every=2), {"divide_by_ranks": False}),
]


def _groups(rank: int):
    """Every rank makes every group (dist.new_group is collective on WORLD): each region's, each index's."""
    regions = [dist.new_group([r * PER_REGION + i for i in range(PER_REGION)]) for r in range(REGIONS)]
    across = [dist.new_group([r * PER_REGION + i for r in range(REGIONS)]) for i in range(PER_REGION)]
    return regions[rank // PER_REGION], across[rank % PER_REGION]


def _worker(rank: int, world: int) -> dict:
    region_group, outer_group = _groups(rank)
    out = {}
    for name, opt_name, mode, m, outer, options in CONFIGS:
        cls, kw = OPTIMIZERS[opt_name]
        model = make_model()
        theta0 = [p.detach().clone() for p in model.parameters()]
        opt = AccoOptimizer(model.parameters(), cls, mode=mode, microbatches_per_update=m, process_group=region_group,
                            outer_group=outer_group, estimate_dtype=None, **outer, **options, **kw)
        traj = []
        share = 1 if options.get("divide_by_ranks", True) else 1 / (REGIONS * PER_REGION)
        for t in range(UPDATES):
            for j in range(m):
                (loss_fn(model, rank, t * m + j) * share / m).backward()
            opt.step()
            opt.zero_grad()
            traj.append(flat(model))
        report = opt.memory_report()
        opt.finish()

        def region_fn(r, m=m):
            return lambda i, j, w: [g / m for g in grad_fn(r * PER_REGION + i, j, w)]

        oracle_options = dict(estimate_extrapolation=opt.estimate_extrapolation,
                              compression=options.get("compression"),
                              compression_block=options.get("compression_block", 256),
                              synchronous_updates=options.get("synchronous_updates", 0),
                              max_grad_norm=options.get("max_grad_norm"),
                              delay_correction=options.get("delay_correction", 0.0))
        ref = regions_run(theta0, lambda ps: cls(ps, **kw), mode, [region_fn(r) for r in range(REGIONS)], PER_REGION,
                          UPDATES, m, outer["outer_every"], outer.get("outer_delay", 0), outer.get("outer_lr", 0.7),
                          outer.get("outer_momentum", 0.9), outer.get("outer_compression"), **oracle_options)
        mine = ref[rank // PER_REGION]
        alone = update_run(theta0, lambda ps: cls(ps, **kw), mode, region_fn(rank // PER_REGION), PER_REGION,
                           UPDATES, m, **oracle_options)  # the region without the outer round
        out[name] = {
            "step_err": max(rel_err(a, flat_list(b)) for a, b in zip(traj, mine[0])),
            "errs": [rel_err(a, flat_list(b)) for a, b in zip(traj, mine[0])],
            "final_err": rel_err(flat(model), flat_list(mine[2])),
            "vs_alone": rel_err(flat(model), flat_list(alone[2])),
            "traj": traj,
            "outer_bytes": report.get("outer", 0),
            "master_bytes": report["master"],
        }
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return run_ranks(_worker, REGIONS * PER_REGION)


@pytest.mark.parametrize("name", [c[0] for c in CONFIGS])
def test_regions_match_the_oracle(name):
    """The model after every step() and after finish(), on every rank of both regions, against regions_run; the
    outer round changed something (the region alone ends elsewhere); after an undelayed outer round at the last
    update both regions hold the same weights."""
    _, _, _, _, outer, options = next(c for c in CONFIGS if c[0] == name)
    results = [res[name] for res in _results()]
    for rank, res in enumerate(results):
        assert res["step_err"] < TOL, (rank, res["step_err"])
        assert res["final_err"] < TOL, (rank, res["final_err"])
        assert res["vs_alone"] > 1e-4, (rank, res["vs_alone"])
    mode, every = next(c for c in CONFIGS if c[0] == name)[2], outer["outer_every"]
    if mode == "sync" and not outer.get("outer_delay"):  # the model holds theta after step(): equal after a merge
        for k in range(1, UPDATES + 1):
            same = torch.equal(results[0]["traj"][k - 1], results[PER_REGION]["traj"][k - 1])
            assert same == (k % every == 0), (k, same)


def test_the_outer_state_is_a_slice():
    """memory_report()["outer"]: the anchor and the momentum of this rank's slice (each as many bytes as the master
    slice), the launch's copy with outer_delay > 0, and the round's bytes out and in; with int8, a residual and a
    quarter of the bytes."""
    res = _results()[0]
    plain, int8 = res["adamw/acco/every2"], res["adamw/acco/every2-int8"]
    delayed = res["adamw/acco/every3-delay1"]
    master = plain["master_bytes"]
    assert plain["outer_bytes"] == 2 * master + master + REGIONS * master, plain
    assert delayed["outer_bytes"] == 3 * master + master + REGIONS * master, delayed
    n = master // 4
    packed = 4 * -(-n // 16) + 4 * -(-n // 4)
    assert int8["outer_bytes"] == 3 * master + packed * (1 + REGIONS), int8


def _refusals(rank: int, world: int) -> dict:
    region_group, outer_group = _groups(rank)
    out = {}

    def attempt(name, make):
        try:
            opt = make()
        except Exception as exc:  # noqa: BLE001 - the refusal is what is recorded
            out[name] = f"{type(exc).__name__}: {exc}"
            return None
        return opt

    params = lambda: make_model().parameters()  # noqa: E731
    # every rank of the world as "the regions": rank i of a region meets ranks of other indices
    attempt("world", lambda: AccoOptimizer(params(), mode="sync", process_group=region_group, outer_every=2,
                                           outer_group=dist.group.WORLD))
    attempt("no_every", lambda: AccoOptimizer(params(), mode="sync", process_group=region_group,
                                              outer_group=outer_group))
    # regions that differ in their options
    attempt("options", lambda: AccoOptimizer(params(), mode="sync", process_group=region_group, outer_every=2,
                                             outer_group=outer_group, lr=1e-3 * (1 + rank // PER_REGION)))
    opt = attempt("ok", lambda: AccoOptimizer(params(), mode="sync", process_group=region_group, outer_every=2,
                                              outer_group=outer_group))
    for call in ("sharded_state_dict", "consolidated_state_dict"):
        try:
            getattr(opt, call)()
        except NotImplementedError as exc:
            out[call] = str(exc)
    try:
        acco.checkpoint.gather(opt)
    except NotImplementedError as exc:
        out["gather"] = str(exc)
    opt.finish()
    return out


def test_refusals_across_regions():
    """Groups that are not regions, regions that differ, and the checkpoint forms that cannot tell regions apart
    (gathered, consolidated, the bare DCP entries) are refused on every rank, naming what to do."""
    for rank, out in enumerate(run_ranks(_refusals, REGIONS * PER_REGION)):
        assert "ok" not in out, out["ok"]
        assert "outer_group must join rank i of every region" in out["world"], out["world"]
        assert "outer_group= without outer_every" in out["no_every"], out["no_every"]
        assert "disagree on the hyper-parameters" in out["options"], out["options"]
        for call in ("sharded_state_dict", "consolidated_state_dict", "gather"):
            assert "the regions hold different weights and states under the same keys" in out[call], (rank, call)


@pytest.mark.parametrize("options,error,match", [
    (dict(outer_every=0), ValueError, "outer_every must be None or an int >= 1"),
    (dict(outer_every=3, outer_delay=3), ValueError, "0 <= outer_delay < outer_every=3"),
    (dict(outer_every=3, outer_lr=0.0), ValueError, "outer_lr must be a number > 0"),
    (dict(outer_every=3, outer_momentum=1.0), ValueError, r"outer_momentum must be a number in \[0, 1\)"),
    (dict(outer_every=3, outer_compression="int2"), ValueError, "outer_compression must be None or one of"),
    (dict(outer_momentum=0.5), ValueError, "outer_momentum without outer_every"),
    (dict(outer_every=3), ValueError, "without outer_group="),
    (dict(outer_every=3, accumulate_while_communicating=True), ValueError, "accumulate_while_communicating"),
])
def test_outer_options_are_checked(options, error, match):
    with pytest.raises(error, match=match):
        AccoOptimizer(make_model().parameters(), mode="sync", **options)


@pytest.mark.slow  # make test-all only: two torchrun launches of 4 ranks
def test_the_example_runs_under_torchrun():
    """examples/regions/train.py as docs/regions.md launches it: 2 regions x 2 ranks on a ("region", "dp") mesh.
    After an undelayed outer round at the last update the regions hold the same weights; with a delay, and the
    round compressed, they hold their own (the last round is still in flight at the end)."""
    import re
    import sys
    from pathlib import Path

    from _dist import run_command

    train = Path(__file__).resolve().parents[1] / "examples" / "regions" / "train.py"
    small = ["--updates", "6", "--dim", "32", "--seq-len", "32", "--batch", "4"]

    def launch(*args):
        return run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                            str(train), *small, *args], timeout=300)

    synced = launch("--every", "3")
    assert "regions hold the same weights: True" in synced, synced
    assert len(re.findall(r"^update \d+ loss ", synced, re.M)) == 6, synced
    delayed = launch("--every", "3", "--delay", "1", "--outer-compression", "int8")
    assert "regions hold the same weights: False" in delayed, delayed
    held = re.search(r"held-out loss by region: (\S+), (\S+)$", delayed, re.M)
    assert held and held.group(1) != held.group(2), delayed


RESUME = dict(outer_every=3, outer_delay=2, outer_compression="int8")  # launched at 3, merged at 5


def _resume(rank: int, world: int, stop: int, folder: str) -> dict:
    """8 updates straight, and the same stopped after ``stop`` updates, saved and resumed into fresh objects:
    per rank (opt.state_dict() and the committed model), or (``folder``) with acco.checkpoint.save/load."""
    region_group, outer_group = _groups(rank)

    def build():
        model = make_model()
        opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, microbatches_per_update=2,
                            process_group=region_group, outer_group=outer_group, compression_block=16, lr=1e-2,
                            **RESUME)
        return model, opt

    def train(model, opt, updates):
        for t in updates:
            for j in range(2):
                (loss_fn(model, rank, t * 2 + j) / 2).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    train(model, opt, range(8))
    opt.finish()
    straight = flat(model)
    model, opt = build()
    train(model, opt, range(stop))
    if folder:
        acco.checkpoint.save(folder, opt, model=model)
        saved = {}
    else:
        saved = opt.state_dict()
        with opt.committed_weights():
            weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt.finish()
    model, opt = build()
    if folder:
        acco.checkpoint.load(folder, opt, model=model)
    else:
        model.load_state_dict(weights)
        opt.load_state_dict(saved)
    train(model, opt, range(stop, 8))
    opt.finish()
    return {"resumed": flat(model), "straight": straight, "keys": sorted(saved.get("outer", {}))}


@pytest.mark.parametrize("form", ["per-rank", "dcp"])
@pytest.mark.parametrize("stop", [4, 6])
def test_a_region_resumes_bit_identically(stop, form, tmp_path):
    """Stopped after 4 updates (an outer round in flight, due at 5) or 6 (one just launched, due at 8: the end),
    saved (each rank's state_dict(), or acco.checkpoint's one folder for every region) and resumed: every rank
    ends on the very weights of the straight run."""
    folder = str(tmp_path / "ckpt") if form == "dcp" else ""
    for rank, res in enumerate(run_ranks(_resume, REGIONS * PER_REGION, stop, folder)):
        assert torch.equal(res["resumed"], res["straight"]), (rank, (res["resumed"] - res["straight"]).abs().max())
        if not folder:
            assert res["keys"] == ["anchor", "base", "counters", "momentum", "received", "residual"], res["keys"]


def _edges(rank: int, world: int, folder: str) -> dict:
    """take_model_weights() across regions, fp64 parameters, a per-rank state saved without outer_every loaded
    into a run with it, and a DCP checkpoint of 2 regions x 2 ranks (read back on 2 x 1 by the test)."""
    region_group, outer_group = _groups(rank)
    out = {}
    places = dict(process_group=region_group, outer_group=outer_group, outer_every=2)
    # take_model_weights: each region's own weights, then the first region's everywhere, the anchor with them
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="sync", **places)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0 + rank // PER_REGION)
    opt.take_model_weights()
    outer = opt.runtime.driver.ctx.outer
    out["taken"] = flat(model)
    out["anchor_is_master"] = torch.equal(outer.anchor, opt.runtime.flat.shard.master)
    opt.finish()
    # fp64 parameters: the pseudo-gradient travels in fp32, the anchor steps in fp64
    model64 = make_model().double()
    opt = AccoOptimizer(model64.parameters(), mode="sync", microbatches_per_update=1, **places)
    for t in range(4):
        (model64(torch.ones(2, 5, dtype=torch.float64)) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.finish()
    out["fp64_finite"] = bool(torch.isfinite(flat(model64)).all())
    # a per-rank state saved without outer_every, loaded into a run with it: the outer rounds start from it
    model = make_model()
    plain = AccoOptimizer(model.parameters(), mode="sync", microbatches_per_update=1, process_group=region_group)
    for t in range(2):  # the same data in both regions: the same weights, as regions starting from one state
        (loss_fn(model, rank % PER_REGION, t)).backward()
        plain.step()
        plain.zero_grad()
    saved = plain.state_dict()
    plain.finish()
    opt = AccoOptimizer(model.parameters(), mode="sync", microbatches_per_update=1, **places)
    opt.load_state_dict(saved)
    outer = opt.runtime.driver.ctx.outer
    out["started_from_load"] = (torch.equal(outer.anchor, opt.runtime.flat.shard.master) and outer.commits == 2
                                and bool((opt.runtime.flat.shard.master != 0).any()))
    for t in range(2, 4):
        (loss_fn(model, rank, t)).backward()
        opt.step()
        opt.zero_grad()
    acco.checkpoint.save(folder, opt, model=model)
    opt.finish()
    return out


def _reshard(rank: int, world: int, folder: str) -> str:
    """2 regions of 1 rank load the checkpoint 2 regions of 2 ranks wrote."""
    alone = [dist.new_group([r]) for r in range(world)]
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="sync", microbatches_per_update=1, process_group=alone[rank],
                        outer_group=dist.group.WORLD, outer_every=2)
    try:
        acco.checkpoint.load(folder, opt, model=model)
    except Exception as exc:  # noqa: BLE001 - the refusal is what is checked
        return f"{type(exc).__name__}: {exc}"
    finally:
        opt.finish()
    return "loaded"


def test_take_model_weights_fp64_a_plain_state_and_resharding(tmp_path):
    """take_model_weights() gives every region the first region's weights and the anchor with them; fp64
    parameters train; a per-rank state saved without outer_every starts the outer rounds from its weights; a DCP
    checkpoint of 2 ranks per region is refused on 1 rank per region, naming why."""
    folder = str(tmp_path / "ckpt")
    results = run_ranks(_edges, REGIONS * PER_REGION, folder)
    for rank, res in enumerate(results):
        assert torch.equal(res["taken"], results[0]["taken"]) and res["anchor_is_master"], rank
        assert res["fp64_finite"] and res["started_from_load"], (rank, res)
    for message in run_ranks(_reshard, 2, folder):
        assert message.startswith("CheckpointError") and "written by 2 ranks per region, this run has 1" in message, \
            message


@pytest.mark.slow  # make test-all only: a killed rank restarted by torchrun, twice 4 ranks
def test_a_region_killed_restarts_from_the_last_checkpoint(tmp_path):
    """Rank 3 (the second region) killed before its update 8, the outer round launched at 6 in flight (due at 8),
    under torchrun --max-restarts=1: every rank restarts from the checkpoint after update 4 (its outer round
    launched at 3 in flight too) and ends on the weights of a run never interrupted, each region its own."""
    import sys
    from pathlib import Path

    from _dist import run_command

    script = Path(__file__).resolve().parent / "regions_resume_script.py"

    def launch(out, kill_at):
        run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                     "--max-restarts=1", "--monitor-interval=0.5", str(script), str(out), "10", "4", str(kill_at)],
                    timeout=300)
        return [torch.load(out / f"final{r}.pt", weights_only=True) for r in range(REGIONS * PER_REGION)]

    clean, killed = launch(tmp_path / "clean", -1), launch(tmp_path / "killed", 7)
    for rank, (a, b) in enumerate(zip(clean, killed)):
        assert a["attempt"] == 0 and a["start"] == 0, (rank, a)
        assert b["attempt"] == 1 and b["start"] == 4, (rank, b)  # the checkpoint after update 4
        assert torch.equal(a["w"], b["w"]), (rank, (a["w"] - b["w"]).abs().max())
    assert not torch.equal(clean[0]["w"], clean[2]["w"])  # the regions differ (the last round still in flight)
