"""Bad input fails at construction with a message naming the value and the fix."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
from torch import nn

from _dist import run_ranks
from tinynet import loss_fn, make_model

import acco
from acco import AccoOptimizer


def _frozen():
    m = nn.Linear(2, 2)
    m.requires_grad_(False)
    return m.parameters()


def _dup():
    p = nn.Parameter(torch.ones(2))
    return [p, nn.Parameter(torch.ones(3)), p]


class _MyElementwise(torch.optim.SGD):
    """A user's own optimizer: acco cannot know it is element-wise."""


CASES = [
    ("no parameters", lambda: ([],), {}, ValueError, "empty parameter list"),
    ("all frozen", lambda: (_frozen(),), {}, ValueError, "requires_grad=True"),
    ("a single tensor", lambda: (nn.Parameter(torch.ones(2)),), {}, TypeError, "iterable of Tensors"),
    ("not tensors", lambda: ([1.0, 2.0],), {}, TypeError, "expected torch.Tensor"),
    ("integer parameter", lambda: ([torch.zeros(3, dtype=torch.int64)],), {}, TypeError, "floating-point"),
    ("sparse parameter", lambda: ([torch.zeros(3, 3).to_sparse().requires_grad_()],), {}, TypeError, "dense"),
    ("two devices", lambda: ([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, device="meta"))],), {}, ValueError, "one device"),
    ("two dtypes", lambda: ([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, dtype=torch.float64))],), {}, TypeError, "one dtype"),
    ("optimizer instance", lambda: (make_model().parameters(), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1)), {}, TypeError, "Optimizer subclass"),
    ("optimizer not a class", lambda: (make_model().parameters(), "adamw"), {}, TypeError, "optimizer_class"),
    ("unknown mode", lambda: (make_model().parameters(),), {"mode": "fast"}, ValueError, "'fast'"),
    ("min > max", lambda: (make_model().parameters(),), {"min_microbatches": 3, "max_microbatches": 2, "accumulate_while_communicating": True}, ValueError, "min_microbatches=3 > max_microbatches=2"),
    ("min < 1", lambda: (make_model().parameters(),), {"min_microbatches": 0, "accumulate_while_communicating": True}, ValueError, "min_microbatches"),
    ("bad kwarg", lambda: (make_model().parameters(),), {"momentum": 0.9}, TypeError, "momentum"),
    ("max_grad_norm <= 0", lambda: (make_model().parameters(),), {"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
    ("unknown nonfinite policy", lambda: (make_model().parameters(),), {"nonfinite": "ignore"}, ValueError, "'ignore'"),
    ("acco with one micro-batch per update", lambda: (make_model().parameters(),), {"microbatches_per_update": 1}, ValueError, "two halves.*mode='dpu'"),
    ("microbatches_per_update 0", lambda: (make_model().parameters(),), {"mode": "sync", "microbatches_per_update": 0}, ValueError, "microbatches_per_update"),
    ("max_microbatches without accumulating", lambda: (make_model().parameters(),), {"max_microbatches": 2}, ValueError, "only with accumulate_while_communicating=True"),
    ("per-update count while accumulating", lambda: (make_model().parameters(),), {"microbatches_per_update": 2, "accumulate_while_communicating": True}, ValueError, "one or the other"),
    ("accumulate flag not a bool", lambda: (make_model().parameters(),), {"accumulate_while_communicating": "yes"}, TypeError, "True or False"),
    ("buffers a single tensor", lambda: (make_model().parameters(),), {"buffers": torch.zeros(2)}, TypeError, "model.buffers"),
    ("buffers not tensors", lambda: (make_model().parameters(),), {"buffers": [1.0]}, TypeError, "model.buffers"),
    ("fp16 parameters", lambda: (make_model().half().parameters(),), {}, TypeError, "autocast.*GradScaler.*bfloat16"),
    ("fp16 compute dtype", lambda: (make_model().parameters(),), {"compute_dtype": torch.float16}, TypeError, "GradScaler"),
    ("meta-device parameters", lambda: (make_model().to("meta").parameters(),), {}, ValueError, "meta device.*to_empty"),
    ("a parameter twice in one list", lambda: (_dup(),), {}, ValueError, "parameter 2 .* is also parameter 0"),
    ("a parameter in two groups", lambda: (lambda ps: ([{"params": ps[:2]}, {"params": ps[2:]}],))(_dup()), {}, ValueError, "more than one"),
    ("LBFGS (needs a closure)", lambda: (make_model().parameters(), torch.optim.LBFGS), {}, ValueError, "LBFGS cannot be wrapped.*closure"),
    ("reduce_dtype narrower than the compute dtype", lambda: (make_model().parameters(),), {"reduce_dtype": torch.bfloat16}, TypeError, "at least as wide as the compute dtype"),
    ("reduce_dtype float16", lambda: (make_model().parameters(),), {"reduce_dtype": torch.float16}, TypeError, "reduce_dtype must be"),
    ("two dtypes with compute_dtype", lambda: ([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, dtype=torch.float64))],), {"compute_dtype": torch.bfloat16}, TypeError, r"one dtype.*casts a model of one dtype.*model.to\(torch.float32\)"),
    ("timeout zero", lambda: (make_model().parameters(),), {"timeout": __import__("datetime").timedelta(0)}, ValueError, "give up at once.*positive datetime.timedelta"),
    ("timeout in seconds", lambda: (make_model().parameters(),), {"timeout": 30}, TypeError, "must be a datetime.timedelta"),
    ("estimate_dtype in mode sync", lambda: (make_model().parameters(),), {"mode": "sync", "estimate_dtype": torch.bfloat16}, ValueError, "mode='acco' only"),
    ("estimate_dtype not narrower", lambda: (make_model().parameters(),), {"estimate_dtype": torch.float32}, ValueError, "not narrower.*save no bytes"),
    ("estimate_dtype an unknown name", lambda: (make_model().parameters(),), {"estimate_dtype": "bf16"}, ValueError, "must be 'auto', torch.bfloat16 or None, got 'bf16'"),
    ("estimate_dtype float16", lambda: (make_model().parameters(),), {"estimate_dtype": torch.float16}, TypeError, "must be 'auto', torch.bfloat16 or None"),
    ("synchronous_updates negative", lambda: (make_model().parameters(),), {"synchronous_updates": -1}, ValueError, "synchronous_updates must be"),
    ("synchronous_updates while accumulating", lambda: (make_model().parameters(),), {"accumulate_while_communicating": True, "synchronous_updates": 5}, ValueError, "one step\\(\\) per update"),
    ("estimate_microbatches zero", lambda: (make_model().parameters(),), {"microbatches_per_update": 4, "estimate_microbatches": 0}, ValueError, "estimate_microbatches must be None or an int >= 1, got 0"),
    ("estimate_extrapolation out of range", lambda: (make_model().parameters(),), {"estimate_extrapolation": 2.5}, ValueError, "estimate_extrapolation must be 'auto' or a number in \\(0, 2\\], got 2.5: 1.0 is the paper's estimate, 1.2 what 'auto' takes for Adam and AdamW"),
    ("estimate_extrapolation not a number", lambda: (make_model().parameters(),), {"estimate_extrapolation": "1.2"}, ValueError, "estimate_extrapolation must be 'auto' or a number in \\(0, 2\\], got '1.2'"),
    ("estimate_extrapolation in mode dpu", lambda: (make_model().parameters(),), {"mode": "dpu", "estimate_extrapolation": 1.2}, ValueError, "estimate_extrapolation=1.2 applies to mode='acco' only"),
    ("delay_correction in mode acco", lambda: (make_model().parameters(),), {"delay_correction": 1.0}, ValueError, "delay_correction=1.0 applies to mode='dpu' only.*mode='acco'.*estimate_extrapolation"),
    ("delay_correction out of range", lambda: (make_model().parameters(),), {"mode": "dpu", "delay_correction": -1}, ValueError, "delay_correction must be a number in \\[0, 2\\], got -1"),
    ("delay_correction while accumulating", lambda: (make_model().parameters(),), {"mode": "dpu", "accumulate_while_communicating": True, "delay_correction": 1.0}, ValueError, "delay_correction=1.0 needs one step\\(\\) per update"),
    ("estimate_microbatches in mode sync", lambda: (make_model().parameters(),), {"mode": "sync", "estimate_microbatches": 1}, ValueError, "applies to mode='acco' only"),
    ("estimate_microbatches while accumulating", lambda: (make_model().parameters(),), {"accumulate_while_communicating": True, "estimate_microbatches": 1}, ValueError, "estimate_microbatches=1 applies to one step\\(\\) per update"),
    ("estimate_microbatches not below the update's", lambda: (make_model().parameters(),), {"microbatches_per_update": 4, "estimate_microbatches": 4}, ValueError, "estimate_microbatches=4 with 4 micro-batches per update.*at least one after it.*below 4"),
    ("Muon on biases (1-D)", lambda: (make_model().parameters(), torch.optim.Muon), {}, ValueError, "Muon orthogonalises 2-D matrices only.*'optimizer_class': torch.optim.Muon"),
    ("SparseAdam (sparse gradients)", lambda: (make_model().parameters(), torch.optim.SparseAdam), {}, ValueError, "SparseAdam cannot be wrapped.*sparse gradients"),
    ("a user's optimizer without opt-in", lambda: (make_model().parameters(), _MyElementwise), {}, ValueError, "_MyElementwise.*placement='elementwise'.*placement='whole'"),
    ("unknown placement", lambda: (make_model().parameters(), _MyElementwise), {"placement": "rows"}, ValueError, "placement must be None, 'elementwise' or 'whole'"),
    ("a group's optimizer_class not a class", lambda: ([{"params": list(make_model().parameters()), "optimizer_class": "Muon"}],), {}, TypeError, "param group 0's 'optimizer_class'"),
    ("assume_elementwise not a bool", lambda: (make_model().parameters(), _MyElementwise), {"assume_elementwise": 1}, TypeError, "True or False"),
    ("process_group without init", lambda: (make_model().parameters(),), {"process_group": object()}, RuntimeError, "not initialised"),
    ("int compute dtype", lambda: (make_model().parameters(),), {"compute_dtype": torch.int8}, TypeError, "compute_dtype"),
    ("fp16 accumulation dtype", lambda: (make_model().parameters(),), {"accumulation_dtype": torch.float16}, TypeError, "accumulation_dtype must be"),
    ("accumulation narrower than compute", lambda: (make_model().float().parameters(),), {"accumulation_dtype": torch.bfloat16}, TypeError, "narrower than the compute dtype"),
]


@pytest.mark.parametrize("name,args,kwargs,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(name, args, kwargs, exc, match):
    """Check that each bad input raises the right exception type with a message naming the value."""
    with pytest.raises(exc, match=match):
        AccoOptimizer(*args(), **kwargs)


def test_a_users_elementwise_optimizer_with_opt_in_trains():
    """Check that assume_elementwise=True accepts an optimizer acco does not know, and it trains."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), _MyElementwise, mode="sync", assume_elementwise=True, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, 0, 0).backward()
    opt.step()
    opt.finish()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_add_param_group_after_construction_raises():
    """Check that add_param_group() (inherited from torch.optim.Optimizer) is refused, not silently ignored."""
    model = make_model()
    opt = AccoOptimizer(list(model.parameters())[:2], mode="sync", lr=1e-2)
    with pytest.raises(RuntimeError, match="add_param_group.*laid out at construction.*all param groups"):
        opt.add_param_group({"params": list(model.parameters())[2:]})
    assert len(opt.param_groups) == 1


def test_state_dict_mid_update_raises():
    """Check that state_dict() between the micro-batches of one update says when to call it."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), microbatches_per_update=2, lr=1e-2)
    loss_fn(model, 0, 0).backward()
    with pytest.raises(RuntimeError, match="mid-update.*between a step"):
        opt.state_dict()


def test_step_after_finish_raises():
    """Check that step() after finish() raises instead of training on a closed optimizer."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="sync", lr=1e-2)
    loss_fn(model, 0, 0).backward()
    opt.step()
    opt.finish()
    opt.finish()  # idempotent
    with pytest.raises(RuntimeError, match="after finish"):
        opt.step()


def test_world_size_without_process_group_raises(monkeypatch):
    """Check that WORLD_SIZE>1 without an initialised process group is an error, not a silent single-process run."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group.*AccoTrainer"):
        AccoOptimizer(make_model().parameters(), lr=1e-2)


# (name, AccoOptimizer kwargs on rank 1 where rank 0 has the defaults below, words in the message)
RANK_MISMATCHES = [
    ("model", {"model": "other"}, "the model"),
    ("lr", {"lr": 2e-2}, "hyper-parameters of the param groups"),
    ("weight_decay", {"weight_decay": 0.5}, "hyper-parameters of the param groups"),
    ("max_grad_norm", {"max_grad_norm": 1.0}, "max_grad_norm"),
    ("compute_dtype", {"compute_dtype": torch.bfloat16}, "compute_dtype"),
    ("nonfinite", {"nonfinite": "raise"}, "nonfinite"),
    ("mode", {"mode": "dpu"}, "mode"),
    ("optimizer_class", {"optimizer_class": torch.optim.Adam}, "optimizer_class"),
    ("microbatches_per_update", {"microbatches_per_update": 4}, "microbatches_per_update"),
    ("timeout", {"timeout": datetime.timedelta(seconds=30)}, "timeout"),  # would build a group on one rank only
    ("estimate_microbatches", {"estimate_microbatches": 3}, "estimate_microbatches"),  # hand-offs out of step
    ("estimate_extrapolation", {"estimate_extrapolation": 1.0}, "estimate_extrapolation"),  # against "auto": 1.2
    ("delay_correction", {"delay_correction": 1.0}, "delay_correction"),  # updates differ
    ("compression", {"compression": "int8"}, "compression"),  # an all-to-all against a reduce-scatter
    ("compression_block", {"compression": "int8", "compression_block": 64}, "compression_block"),
    ("compression_weights", {"compression": "int8", "compression_weights": False}, "compression_weights"),
]
BOTH_RANKS = {"estimate_microbatches": dict(mode="acco", microbatches_per_update=4),
              "estimate_extrapolation": dict(mode="acco"), "delay_correction": dict(mode="dpu"),
              "compression_block": dict(compression="int8"), "compression_weights": dict(compression="int8")}


def _mismatch_worker(rank: int, world: int) -> dict:
    out = {}
    for name, change, _ in RANK_MISMATCHES:
        kw = {**dict(mode="sync", lr=1e-2, weight_decay=0.01), **BOTH_RANKS.get(name, {})}
        model = make_model()
        if rank == 1:
            kw.update(change)
            if kw.pop("model", None):
                model = nn.Linear(4, 3)
        cls = kw.pop("optimizer_class", torch.optim.AdamW)
        try:
            AccoOptimizer(model.parameters(), cls, **kw).finish()
            out[name] = "no error"
        except RuntimeError as exc:
            out[name] = str(exc)
    return out


def test_options_that_differ_across_ranks_fail_on_every_rank():
    """Check that a different model, lr, weight_decay, max_grad_norm, compute_dtype, nonfinite, mode, optimizer
    class, micro-batch count, timeout or estimate hand-off on one rank is reported on every rank at construction, naming what differs."""
    for rank, res in enumerate(run_ranks(_mismatch_worker, 2, timeout=120)):
        for name, _, words in RANK_MISMATCHES:
            msg = res[name]
            assert "disagree" in msg and words in msg and "rank 0" in msg and "rank 1" in msg, (rank, name, msg)


def _hyper_changed_worker(rank: int, world: int) -> str:
    model = make_model()
    opt = AccoOptimizer(model.parameters(), microbatches_per_update=2, lr=1e-2)
    try:
        for t in range(4):
            if t == 2 and rank == 1:
                opt.param_groups[0]["lr"] = 5e-3  # a scheduler stepped on one rank only
            for j in range(2):
                loss_fn(model, rank, 2 * t + j).backward()
            opt.step()
        opt.finish()
    except acco.HyperParameterMismatchError as exc:
        with pytest.raises(RuntimeError, match="a previous round failed"):
            opt.step()  # and every later call raises at once
        return str(exc)
    return "no error"


def test_hyper_parameters_changed_on_one_rank_fail_every_rank():
    """Check that an lr changed on one rank after construction fails the next round on every rank."""
    for msg in run_ranks(_hyper_changed_worker, 2, timeout=120):
        assert "different hyper-parameters" in msg and "every rank alike" in msg, msg


def _foreign_group_worker(rank: int, world: int) -> str:
    import torch.distributed as dist

    group = dist.new_group(ranks=[0])  # every rank must call new_group; rank 1 is not a member
    if rank == 0:
        AccoOptimizer(make_model().parameters(), process_group=group, mode="sync", lr=1e-2).finish()
        return "member"
    try:
        AccoOptimizer(make_model().parameters(), process_group=group, mode="sync", lr=1e-2)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_process_group_without_this_rank_is_refused():
    """Check that a process_group this rank is not a member of gives a clear error (not 'world_size -1')."""
    member, other = run_ranks(_foreign_group_worker, 2, timeout=120)
    assert member == "member"
    assert "not a member of the given process_group" in other, other


def _failing_worker(rank: int, world: int) -> None:
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="dpu", lr=1e-2)
    for i in range(100):
        if rank == 1 and i == 2:
            raise ValueError("rank 1 breaks down")
        loss_fn(model, rank, i).backward()
        opt.step()  # rank 0's round waits in a collective for rank 1
    opt.finish()


@pytest.mark.slow
def test_a_failing_rank_fails_the_test_fast():
    """Check that the spawn helper reports a failing rank at once, not at the process-group timeout."""
    with pytest.raises(AssertionError, match="rank 1 failed"):
        run_ranks(_failing_worker, 2, timeout=50)  # a TimeoutError here would mean it hung


def test_frozen_parameters_are_ignored():
    """Check that parameters with requires_grad=False are neither updated nor part of the flat buffers."""
    model = make_model()
    model.fc1.requires_grad_(False)
    frozen = model.fc1.weight.detach().clone()
    opt = AccoOptimizer(model.parameters(), mode="sync", lr=1e-2)
    assert len(opt.runtime.params) == 3 and opt.layout.numel == 18 + 3 + 2
    loss_fn(model, 0, 0).backward()
    opt.step()
    assert torch.equal(model.fc1.weight, frozen) and model.fc1.weight.grad is None


@pytest.mark.parametrize("zero", ["opt", "model_none"])
def test_sparse_gradients_are_densified(zero):
    """Check that nn.Embedding(sparse=True) trains exactly as the dense embedding (gradients densified)."""
    finals = []
    for sparse in (False, True):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=sparse)
        opt = AccoOptimizer(emb.parameters(), mode="sync", lr=1e-2)
        for i in range(4):
            if zero == "model_none":
                emb.zero_grad(set_to_none=True)  # then autograd hands over a sparse tensor
            emb(torch.tensor([i, i + 1, 1])).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.finish()
        finals.append(emb.weight.detach().clone())
    assert torch.equal(finals[0], finals[1])


def test_docs_list_every_construction_case():
    """Check docs/errors.md lists every construction case of this file (the table stays the tests')."""
    import os

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "errors.md")).read()
    missing = [c[0] for c in CASES if f"| {c[0]} |" not in doc]
    assert not missing, missing


def _uneven_update_worker(rank: int, world: int) -> str:
    model = make_model()
    opt = AccoOptimizer(model.parameters(), microbatches_per_update=4, lr=1e-2)
    try:
        for t in range(3):
            m = 1 if (t == 1 and rank == 1) else 4  # rank 1's shard runs short in update 1
            for j in range(m):
                (loss_fn(model, rank, 4 * t + j) / m).backward()
            opt.step()
        opt.finish()
    except acco.RoundMismatchError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_hand_off_different_rounds_fail_every_rank():
    """Check an update with an estimate on one rank and none on another (uneven shards) fails on every rank."""
    for msg in run_ranks(_uneven_update_worker, 2, timeout=120):
        assert "different rounds" in msg and "same number of micro-batches" in msg, msg


def test_consolidated_state_of_another_model_is_refused():
    """load_consolidated_state_dict of a plain AdamW whose tensors have other shapes (another model with as many
    parameters per group) raises and names the shapes, before changing anything."""
    ours = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    other = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    plain = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other(torch.randn(2, 3)).sum().backward()
    plain.step()
    opt = AccoOptimizer(ours.parameters(), microbatches_per_update=2, lr=1e-2)
    master = opt.runtime.flat.master.clone()
    with pytest.raises(ValueError, match=r"parameter 0 has shape \(4, 3\).*has shape \(3, 4\)"):
        opt.load_consolidated_state_dict(plain.state_dict())
    assert torch.equal(opt.runtime.flat.master, master) and not opt.local_optimizer.state
    opt.finish()


def test_shared_store_with_restarts_on_several_hosts_is_refused_naming_the_fix(monkeypatch):
    """Under torchrun with several hosts, --max-restarts and the agent's shared store, a host's failure would
    leave the restarted workers waiting for each other (their restart counts differ): refused before any
    connection, naming TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (tests/test_cluster.py runs the fixed set-up)."""
    import acco

    for key, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1",
                       "GROUP_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match="different restart counts.*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        acco.init_process_group("gloo")


def _different_calls_worker(rank, world):
    """Rank 0 calls finish(), rank 1 load_state_dict(): both must raise, naming both calls."""
    from tinynet import make_model

    from acco import AccoOptimizer

    model = make_model()
    opt = AccoOptimizer(model.parameters(), microbatches_per_update=2, lr=1e-2)
    for m in range(2):
        model(torch.randn(3, 5)).pow(2).mean().backward()
    opt.step()
    sd = opt.state_dict()
    try:
        if rank == 0:
            opt.finish()
        else:
            opt.load_state_dict(sd)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_ranks_in_different_collective_calls_raise_on_every_rank_naming_both():
    from _dist import run_ranks

    for msg in run_ranks(_different_calls_worker, 2):
        assert "different collective calls (rank 0 in finish(), rank 1 in load_state_dict()" in msg, msg
        assert "on every rank" in msg, msg


def _one_rank_only_worker(rank, world, flag, call):
    """Rank 0 makes ``call`` with the optimizer's timeout at 2 s (the process group's is gloo's default, 30 min):
    ``acco.checkpoint.gather()`` (which first meets the others on the rounds' group), or the first update's
    ``step()`` without ``microbatches_per_update`` (which agrees on the count on the control group alone); rank 1
    does not, and stays alive until rank 0 has raised, 10 s at most: rank 0 gets acco's message within the
    optimizer's timeout, not gloo's alone at the process group's (or when rank 1 leaves)."""
    import datetime
    import os
    import time

    from tinynet import loss_fn, make_model

    import acco.checkpoint
    from acco import AccoOptimizer

    model = make_model()
    per_update = None if call == "first step" else 2
    opt = AccoOptimizer(model.parameters(), microbatches_per_update=per_update, lr=1e-2,
                        timeout=datetime.timedelta(seconds=2))
    out = ("no error", None)
    if rank == 0:
        try:
            if call == "first step":
                for j in range(2):
                    (loss_fn(model, rank, j) / 2).backward()
                opt.step()
            else:
                acco.checkpoint.gather(opt, model=model)
        except RuntimeError as exc:
            out = (str(exc), None)
        open(flag, "w").close()  # rank 1 may leave now
    else:
        until = time.monotonic() + 10
        while not os.path.exists(flag) and time.monotonic() < until:
            time.sleep(0.05)
        out = (None, os.path.exists(flag))  # whether rank 0 raised while this rank was still there
    return out


@pytest.mark.slow
@pytest.mark.parametrize("call,name", [("gather", "acco.checkpoint.gather()"),
                                       ("first step", "step() (the first update)")])
def test_a_collective_call_made_on_one_rank_only_says_so(tmp_path, call, name):
    from _dist import run_ranks

    results = run_ranks(_one_rank_only_worker, 2, str(tmp_path / "raised"), call, may_die={1})
    msg = results[0][0]
    # Rank 1 stays 10 s: rank 0 raised before it left, by the optimizer's 2 s timeout, not because rank 1 went.
    assert results[1] is not None and results[1][1], (
        f"rank 0 raised only after rank 1 left (at 10 s), not within the optimizer's 2 s timeout: {results}")
    assert msg.startswith(f"AccoOptimizer {name}: waiting for the other ranks failed"), msg
    assert "every rank must make this call at the same point" in msg, msg


def _one_more_update_worker(rank: int, world: int) -> dict:
    """For each case: rank 1 runs one update more than rank 0, then both make the same collective call."""
    import acco.checkpoint

    out = {}
    for mode, call in CASES_AHEAD:
        model = make_model()
        opt = AccoOptimizer(model.parameters(), mode=mode, microbatches_per_update=2, lr=1e-2)
        try:
            for t in range(3 + rank):
                for j in range(2):
                    (loss_fn(model, rank, 2 * t + j) / 2).backward()
                opt.step()
                opt.zero_grad()
            if call == "finish":
                opt.finish()
            elif call == "gather":
                acco.checkpoint.gather(opt, model=model)
            else:
                opt.consolidated_state_dict()
            out[mode, call] = {"type": None, "error": "no error"}
        except RuntimeError as exc:  # a timeout would be a RoundFailedError naming a dead peer, not this
            out[mode, call] = {"type": type(exc).__name__, "error": str(exc)}
    return out


CASES_AHEAD = [("acco", "finish"), ("dpu", "finish"), ("acco", "gather"), ("sync", "consolidated")]


@pytest.mark.slow
def test_a_rank_one_update_ahead_is_told_on_every_rank():
    """Check that a rank running one update more than its peers, then a collective call (finish(), a checkpoint,
    the consolidated state) on every rank, raises on every rank at once, saying the ranks ran different numbers
    of updates (the extra update's round meets the call's first exchange on the rounds' group), not that a
    peer died: modes acco and dpu with finish(), acco with acco.checkpoint.gather(), sync with
    consolidated_state_dict()."""
    for rank, results in enumerate(run_ranks(_one_more_update_worker, 2, timeout=120)):
        for case in CASES_AHEAD:
            r = results[case]
            assert r["type"] == "RoundMismatchError", (rank, case, r)
            assert "ran different numbers of updates" in r["error"] and "next_update_index" in r["error"], (rank, r)


def test_every_public_exception_lives_in_acco_errors_and_disagreements_are_runtime_errors():
    """One module holds the library's exceptions; those raised for ranks that disagree are RuntimeErrors (as
    torch.distributed's), so ``except RuntimeError`` around a step or a load catches them."""
    import inspect

    import acco
    import acco.errors

    public = {n: o for n, o in vars(acco).items() if inspect.isclass(o) and issubclass(o, BaseException)}
    assert set(public) == set(acco.errors.__all__), sorted(public)
    assert all(o.__module__ == "acco.errors" for o in public.values())
    for cls in (acco.RoundMismatchError, acco.HyperParameterMismatchError, acco.ShardOfAnotherRankError,
                acco.RanksDisagreeError, acco.RoundFailedError):
        assert issubclass(cls, RuntimeError), cls


def _steps_apart_worker(rank: int, world: int) -> str:
    from acco import agreement

    try:
        agreement.all_gather_row(torch.distributed.group.WORLD, [1] * (rank + 1), torch.device("cpu"),
                                 "load_state_dict() / acco.checkpoint.load()")
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_ranks_at_different_steps_of_one_call_are_told_so():
    """Two ranks in the same call at different exchanges of it (one left an earlier call part-way): the message
    names the one call, instead of "different collective calls (rank 0 in X, rank 1 in X)"."""
    for msg in run_ranks(_steps_apart_worker, 2):
        assert "the ranks are at different steps of load_state_dict() / acco.checkpoint.load()" in msg, msg
        assert "different collective calls" not in msg, msg
