"""CUDA stream path: rounds on a side stream ordered by events (needs a GPU)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from oracle import reference_run
from tinynet import TinyNet, batch, flat, flat_list, make_model, rel_err

from acco import AccoOptimizer, StreamScheduler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA stream path requires a CUDA GPU")

KW = dict(lr=1e-2, weight_decay=0.1)


def _loss(model, i):
    x, y = (t.cuda() for t in batch(0, i))
    return ((model(x).float() - y) ** 2).mean()


def _grad_fn(rank, index, weights):
    model = TinyNet().cuda()
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    _loss(model, index).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _run(mode, steps=7):
    model = make_model().cuda()
    theta0 = [p.detach().clone() for p in model.parameters()]
    opt = AccoOptimizer(model.parameters(), mode=mode, accumulate_while_communicating=True, max_microbatches=1, **KW)
    traj = []
    for i in range(steps):
        _loss(model, i).backward()
        opt.step()
        opt.zero_grad()
        traj.append(flat(model).cpu())
    opt.finish()
    ref, ref_final = reference_run(theta0, lambda ps: torch.optim.AdamW(ps, **KW), mode, _grad_fn, [[1] * steps])
    return traj, flat(model).cpu(), ref, ref_final


@pytest.mark.parametrize("mode", ["acco", "dpu", "sync"])
def test_cuda_single_gpu_matches_oracle(mode):
    """Check that the side-stream path gives the oracle's weights after every step and after finish()."""
    traj, final, ref, ref_final = _run(mode)
    assert max(rel_err(a, flat_list(b).cpu()) for a, b in zip(traj, ref[0])) < 1e-5
    assert rel_err(final, flat_list(ref_final).cpu()) < 1e-5


def test_cuda_scheduler_uses_a_side_stream():
    """Check that work submitted to the scheduler runs on a stream other than the current one."""
    sched = StreamScheduler(torch.device("cuda"))
    seen = []
    sched.submit(lambda: seen.append(torch.cuda.current_stream()))
    sched.wait()
    sched.close()
    assert seen[0] != torch.cuda.current_stream()


def test_cuda_nccl_one_rank_bf16():
    """Check NCCL with one rank and a bf16 compute copy: fp32 master, model = bf16(master)."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 's')}", rank=0, world_size=1)
        try:
            model = make_model().cuda()
            opt = AccoOptimizer(model.parameters(), mode="acco", compute_dtype=torch.bfloat16, accumulate_while_communicating=True, max_microbatches=1, **KW)
            for i in range(6):
                x, y = (t.cuda() for t in batch(0, i))
                ((model(x.bfloat16()).float() - y) ** 2).mean().backward()
                opt.step()
            opt.finish()
            master = opt.runtime.flat.master[: opt.layout.numel]
            assert master.dtype == torch.float32
            assert torch.equal(flat(model), master.to(torch.bfloat16).to(torch.float64))
        finally:
            dist.destroy_process_group()


def test_cuda_round_stats_from_events():
    """Check that on CUDA round timings come from events: readable once the device is idle, consistent."""
    model = make_model().cuda()
    opt = AccoOptimizer(model.parameters(), mode="acco", accumulate_while_communicating=True, max_microbatches=1, **KW)
    for i in range(6):
        _loss(model, i).backward()
        opt.step()
    opt.finish()
    torch.cuda.synchronize()
    stats = opt.round_stats()
    assert len(stats) == 6
    for r in stats:
        assert r["round_s"] is not None and r["round_s"] > 0 and r["wait_s"] >= 0 and r["compute_s"] >= 0
        assert r["rank_microbatches"] == [r["local_microbatches"]]


ONE_STEP_CONFIGS = [("acco", {}), ("dpu", {}), ("sync", {}), ("acco", {"estimate_extrapolation": 1.0}),
                    ("acco", {"foreach": True}), ("acco", {"estimate_extrapolation": 1.0, "foreach": True}),
                    ("dpu", {"delay_correction": 1.0})]


@pytest.mark.parametrize("mode,options", ONE_STEP_CONFIGS,
                         ids=[mode + "".join(f"-{k}={v}" for k, v in o.items()) for mode, o in ONE_STEP_CONFIGS])
def test_cuda_one_step_per_update_matches_oracle(mode, options):
    """The default loop (M backward passes, one step()) on the side stream, against the oracle; with AdamW's
    extrapolated estimate (the default, "auto": its step taken with c * lr, its step count on the device) and the
    paper's (estimate_extrapolation=1.0), fused (the default)
    and capturable foreach (foreach=True); mode dpu's error feedback with fused AdamW (undone from the snapshot, not by
    the kernel's own skip)."""
    from oracle import update_run
    from tinynet import grad_fn

    m, updates = 2, 5
    model = make_model().cuda()
    theta0 = [p.detach().cpu().clone() for p in model.parameters()]
    opt = AccoOptimizer(model.parameters(), mode=mode, microbatches_per_update=m, **options, **KW)
    assert opt.scheduler.uses_streams
    # AdamW on CUDA: the fused kernel by default, capturable foreach where foreach was chosen (the groups decide)
    for g in opt.local_optimizer.param_groups:
        assert ((g["capturable"], g["foreach"]) == (True, True)) if options.get("foreach") else (g["fused"] is True)
    traj = []
    for t in range(updates):
        for j in range(m):
            x, y = (v.cuda() for v in batch(0, t * m + j))
            (((model(x) - y) ** 2).mean() / m).backward()
        opt.step()
        opt.zero_grad()
        traj.append(flat(model).cpu())
    opt.finish()
    ref, _, ref_final = update_run(theta0, lambda ps: torch.optim.AdamW(ps, **KW), mode,
                                   lambda r, i, w: [g / m for g in grad_fn(r, i, w)], 1, updates, m,
                                   estimate_extrapolation=opt.estimate_extrapolation,
                                   delay_correction=options.get("delay_correction", 0.0))
    assert max(rel_err(a, flat_list(b)) for a, b in zip(traj, ref)) < 1e-5
    assert rel_err(flat(model).cpu(), flat_list(ref_final)) < 1e-5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_model_on_another_device_than_the_current_one():
    """model.to("cuda:1") without torch.cuda.set_device(1): events and the side stream follow the parameters."""
    torch.cuda.set_device(0)
    model = make_model().to("cuda:1")
    opt = AccoOptimizer(model.parameters(), mode="acco", microbatches_per_update=2, **KW)
    assert opt.scheduler.side_stream.device == torch.device("cuda", 1)
    for t in range(3):
        for j in range(2):
            x, y = (v.to("cuda:1") for v in batch(0, 2 * t + j))
            ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.finish()
    assert torch.isfinite(flat(model)).all()


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_cuda_steady_state_issues_no_host_sync(mode):
    """After the first applied step, whole updates (backward passes, step(), zero_grad()) run under
    torch.cuda.set_sync_debug_mode("error"): any blocking copy or stream synchronisation raises. Data are
    on the device beforehand; the host waits only where the test itself asks (finish())."""
    m = 4
    model = make_model().cuda()
    opt = AccoOptimizer(model.parameters(), mode=mode, microbatches_per_update=m, max_grad_norm=1.0, **KW)
    data = [tuple(v.cuda() for v in batch(0, i)) for i in range(6 * m)]
    for t in range(6):
        if t == 2:  # the first commit has run and created the optimizer's state: from here on, no sync
            torch.cuda.synchronize()
        if t >= 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            for j in range(m):
                x, y = data[t * m + j]
                (((model(x) - y) ** 2).mean() / m).backward()
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    opt.finish()
    assert torch.isfinite(flat(model)).all()


WHOLE_TENSOR_CONFIGS = [(s, mode, {}) for s in ("muon", "adafactor", "split") for mode in ("acco", "sync")]
WHOLE_TENSOR_CONFIGS += [("split", "acco", {"estimate_dtype": torch.bfloat16, "max_grad_norm": 3.0}),
                         ("split", "acco", {"estimate_extrapolation": 1.2})]
WHOLE_TENSOR_IDS = {"estimate_dtype": "-bf16-clip", "estimate_extrapolation": "-extrapolate"}


@pytest.mark.parametrize("setup,mode,options", WHOLE_TENSOR_CONFIGS,
                         ids=[f"{s}-{m}{''.join(WHOLE_TENSOR_IDS[k] for k in o if k in WHOLE_TENSOR_IDS)}"
                              for s, m, o in WHOLE_TENSOR_CONFIGS])
def test_cuda_whole_tensor_optimizers_match_the_oracle(setup, mode, options):
    """Muon, Adafactor and the Muon + AdamW split (whole tensors on the side stream; Adafactor reads its step
    count and norms back to the host) against the oracle run with the same torch optimizers on the same GPU,
    the model after every step() and after finish(). The last two configurations add the bf16 estimate and
    clipping (the clip's norm all-reduce and the device-side skip flags), and the extrapolated estimate
    (estimate_extrapolation: Muon's estimate a lerp from its snapshot, AdamW's its step with c * lr)."""
    from oracle import update_run
    from test_whole_tensors import ALL, MATRICES, Net, _flat, _grad_fn, _rel, _setup

    m, updates = 2, 5
    names = MATRICES if setup == "muon" else ALL
    net = Net(names).cuda()
    theta0 = [p.detach().clone() for p in net.parameters()]
    acco_groups, make_opt = _setup(setup, names)
    groups, cls, kw = acco_groups(net)
    options = {"estimate_dtype": None, **options}
    opt = AccoOptimizer(groups, cls, mode=mode, microbatches_per_update=m, **options, **kw)
    assert opt.scheduler.uses_streams
    traj = []
    for t in range(updates):
        for j in range(m):
            net.loss(0, t * m + j, 1.0 / m).backward()
        opt.step()
        opt.zero_grad()
        traj.append(_flat(net.parameters()))
    opt.finish()
    ref_steps, _, ref_final = update_run(theta0, make_opt, mode, _grad_fn(names, 1.0 / m, "cuda"), 1, updates, m,
                                         estimate_dtype=options["estimate_dtype"],
                                         max_grad_norm=options.get("max_grad_norm"),
                                         estimate_extrapolation=opt.estimate_extrapolation)
    assert max(_rel(a, _flat(b)) for a, b in zip(traj, ref_steps)) < 1e-5
    assert _rel(_flat(net.parameters()), _flat(ref_final)) < 1e-5
    assert (_flat(net.parameters()) - _flat(theta0)).abs().max().item() > 1e-3  # it trained


def _shared_gpu_grad(rank, index, weights):
    net = TinyNet().cuda()
    with torch.no_grad():
        for p, w in zip(net.parameters(), weights):
            p.copy_(w)
    x, y = (t.cuda() for t in batch(rank, index))
    ((net(x) - y) ** 2).mean().div(2).backward()
    return [p.grad.detach().clone() for p in net.parameters()]


def _train_on_the_gpu(model, opt, rank, updates):
    """``updates`` updates of 2 micro-batches of ``rank``'s data on the stream path, then ``finish()``: the model
    after each ``step()``, on the host."""
    assert opt.scheduler.uses_streams
    traj = []
    for t in range(updates):
        for j in range(2):
            x, y = (v.cuda() for v in batch(rank, 2 * t + j))
            ((model(x) - y) ** 2).mean().div(2).backward()
        opt.step()
        opt.zero_grad()
        traj.append(flat(model).cpu())
    opt.finish()
    return traj


def _shared_gpu_worker(rank, world, mode, estimate_dtype, extrapolation=1.0, compressed=None):
    from oracle import update_run

    os.environ["ACCO_RING"] = "0"  # gloo's own collectives: its point-to-point ring has no CUDA tensors
    torch.cuda.set_device(0)
    model = make_model().cuda()
    theta0 = [p.detach().clone() for p in model.parameters()]
    compressed = compressed or {}
    opt = AccoOptimizer(model.parameters(), mode=mode, microbatches_per_update=2, estimate_dtype=estimate_dtype,
                        max_grad_norm=5.0, estimate_extrapolation=extrapolation, compression_block=16, **compressed,
                        **KW)
    traj = _train_on_the_gpu(model, opt, rank, 5)
    ref, _, ref_final = update_run(theta0, lambda ps: torch.optim.AdamW(ps, **KW), mode, _shared_gpu_grad, world, 5,
                                   2, estimate_dtype=estimate_dtype, max_grad_norm=5.0,
                                   estimate_extrapolation=extrapolation, compression_block=16, **compressed)
    return (max(rel_err(a, flat_list(b).cpu()) for a, b in zip(traj, ref)),
            rel_err(flat(model).cpu(), flat_list(ref_final).cpu()))


@pytest.mark.parametrize("mode,estimate_dtype,extrapolation,compressed", [
    ("acco", None, 1.0, None), ("dpu", None, 1.0, None), ("sync", None, 1.0, None), ("acco", torch.bfloat16, 1.0, None),
    ("acco", torch.bfloat16, 1.2, None), ("acco", None, 1.0, {"compression": "int8"}),
    ("acco", None, 1.0, {"compression": "int8", "estimate_compression": "int4"}), ("sync", None, 1.0, {"compression": "int4"})])
def test_cuda_two_gloo_ranks_sharing_one_gpu_match_the_oracle(mode, estimate_dtype, extrapolation, compressed):
    """Two ranks on one GPU (NCCL refuses two ranks on a device; gloo takes CUDA tensors): the stream path at
    world 2 (the side stream, its events, record_stream, the count and norm collectives, the rounds'
    reduce-scatter and all-gather) against the oracle at every step; then the default bf16 estimate
    extrapolated (estimate_extrapolation=1.2), and compressed rounds (their all-to-all and packed all-gather on
    the device, the estimate in a kind of its own). The uncompressed ones ran on the first GPU machine (one H100);
    the compressed ones have not run on a GPU yet."""
    from _dist import run_ranks

    for step_err, final_err in run_ranks(_shared_gpu_worker, 2, mode, estimate_dtype, extrapolation, compressed,
                                         timeout=120):
        assert step_err < 1e-5 and final_err < 1e-5


def _user_paths(script, runs, name, tmp_path):
    """``runs``: each run's arguments after its output folder, for the framework's own AdamW, the library's run
    and the run resumed from the latter's checkpoint; each on one NCCL rank under torchrun, the script in its
    GPU form (ACCO_TEST_CUDA=1: bf16 autocast). The library's run trains as the framework's AdamW does (one
    rank: the same updates, up to bf16 autocast and the two-stage update's delay), and the resumed run ends
    where the uninterrupted one did."""
    from test_integrations import _result, _torchrun

    res = {}
    for k, args in runs.items():
        _torchrun(script, tmp_path / k, *args, nproc=1, env={"ACCO_TEST_CUDA": "1"})
        res[k] = _result(tmp_path / k)
    base, acco_, resumed = res["adamw"]["eval_loss"], res["acco"]["eval_loss"], res["resumed"]["eval_loss"]
    worst = max((res["acco"]["final"][n].float() - t.float()).abs().max().item()
                for n, t in res["resumed"]["final"].items())
    print(f"{name} on CUDA, bf16 autocast: eval loss AdamW {base:.5f}, acco {acco_:.5f} "
          f"({(acco_ - base) / base:+.3%}), resumed {resumed:.5f}; largest weight difference resumed vs "
          f"uninterrupted {worst:.3g}")
    assert abs(acco_ - base) / base < 0.02
    assert abs(resumed - acco_) / acco_ < 1e-3 and worst < 1e-2


def test_cuda_hf_trainer_bf16_with_a_resume(tmp_path):
    """AccoTrainer on one GPU under torchrun (NCCL) with TrainingArguments(bf16=True), as GPU users run the
    Trainer: its eval loss against Trainer's own AdamW, and resume_from_checkpoint (checkpoint-10)."""
    pytest.importorskip("transformers")
    runs = {"adamw": ["adamw"], "acco": ["acco"], "resumed": ["acco", tmp_path / "acco" / "checkpoint-10"]}
    _user_paths("hf_trainer_script.py", runs, "Trainer", tmp_path)


def test_cuda_accelerate_bf16_with_a_resume(tmp_path):
    """The accelerate recipe on one GPU under torchrun (NCCL) with mixed_precision="bf16": its eval loss
    against accelerate's own AdamW loop, and save_state/load_state at update 10."""
    pytest.importorskip("accelerate")
    runs = {"adamw": ["adamw"], "acco": ["acco", "--save-at", "10"],
            "resumed": ["acco", "--resume", tmp_path / "acco" / "ckpt"]}
    _user_paths("accelerate_script.py", runs, "accelerate", tmp_path)


def _regions_gpu_worker(rank, world, mode, outer):
    """2 regions x 2 gloo ranks on one GPU (``outer_every``): the outer round's async all-gather and its merge on
    the side stream, against the oracle's regions_run."""
    import torch.distributed as dist
    from oracle import regions_run

    os.environ["ACCO_RING"] = "0"  # gloo's own collectives: its point-to-point ring has no CUDA tensors
    torch.cuda.set_device(0)
    regions = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model = make_model().cuda()
    theta0 = [p.detach().clone() for p in model.parameters()]
    opt = AccoOptimizer(model.parameters(), mode=mode, microbatches_per_update=2, estimate_dtype=None,
                        compression_block=16, process_group=regions[rank // 2], outer_group=across[rank % 2], **outer,
                        **KW)
    traj = _train_on_the_gpu(model, opt, rank, 6)

    def region_grad(r):
        return lambda i, j, w: _shared_gpu_grad(2 * r + i, j, w)

    ref = regions_run(theta0, lambda ps: torch.optim.AdamW(ps, **KW), mode, [region_grad(0), region_grad(1)], 2, 6, 2,
                      outer["outer_every"], outer.get("outer_delay", 0), compression_block=16,
                      outer_compression=outer.get("outer_compression"),
                      estimate_extrapolation=opt.estimate_extrapolation)
    mine = ref[rank // 2]
    return max(rel_err(a, flat_list(b).cpu()) for a, b in zip(traj, mine[0]))


@pytest.mark.parametrize("mode,outer", [
    ("acco", {"outer_every": 2}), ("sync", {"outer_every": 3, "outer_delay": 1, "outer_compression": "int8"}),
    ("acco", {"outer_every": 3, "outer_delay": 2, "outer_compression": "int4"})])
def test_cuda_regions_on_one_gpu_match_the_oracle(mode, outer):
    """Across regions on the stream path (4 gloo ranks sharing one GPU): every step against the oracle. Not run on
    a GPU yet."""
    from _dist import run_ranks

    for step_err in run_ranks(_regions_gpu_worker, 4, mode, outer, timeout=180):
        assert step_err < 1e-5
