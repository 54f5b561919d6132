"""Compressed rounds (``compression="int8" | "fp8" | "int4"``), multi-rank, against the oracle's transcription of
the 8- and 4-bit trips and their error feedback (``docs/algorithm.md``, "Compressed rounds"): every mode, 2, 3 and 4 ranks,
within 1e-5; and what the option refuses."""

from __future__ import annotations

import functools

import pytest
import torch

from _dist import run_ranks
from oracle import update_run
from tinynet import flat, flat_list, grad_fn, loss_fn, make_model, rel_err

from acco import AccoOptimizer

TOL = 1e-5
UPDATES = 6
KW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
OPTIMIZERS = {"adamw": (torch.optim.AdamW, KW),
              "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, weight_decay=0.01))}
# (name, optimizer, mode, micro-batches per update, compression, block, options)
CONFIGS = [(f"{o}/{mode}/{kind}", o, mode, 2, kind, 16, {}) for o in OPTIMIZERS for mode in ("acco", "dpu", "sync")
           for kind in ("int8", "fp8", "int4")]
CONFIGS += [
    ("sgd/acco/int8/m4-block7", "sgd", "acco", 4, "int8", 7, {}),  # blocks that do not divide a chunk
    ("adamw/acco/int8/clipped", "adamw", "acco", 2, "int8", 16, {"max_grad_norm": 0.05}),  # the dequantized norm
    ("adamw/dpu/int8/delay-correction", "adamw", "dpu", 2, "int8", 16, {"delay_correction": 1.0}),
    ("sgd/acco/int8/sync2", "sgd", "acco", 2, "int8", 16, {"synchronous_updates": 2}),
    ("adamw/acco/int8/gradients-only", "adamw", "acco", 2, "int8", 16, {"compression_weights": False}),
    ("sgd/dpu/fp8/gradients-only", "sgd", "dpu", 2, "fp8", 16, {"compression_weights": False}),
    ("sgd/acco/int4/m4-block7", "sgd", "acco", 4, "int4", 7, {}),  # odd blocks: nibbles across a block's edge
    ("adamw/acco/int4/clipped", "adamw", "acco", 2, "int4", 16, {"max_grad_norm": 0.05}),
    ("adamw/acco/int4/gradients-only", "adamw", "acco", 2, "int4", 16, {"compression_weights": False}),
    # the accumulate-while-communicating loop (step() after every micro-batch), one micro-batch a half in mode
    # acco: the default loop's update of two, with the rounds compressed alike
    ("sgd/acco/int8/awc", "sgd", "acco", 2, "int8", 16, {"awc": True}),
    # the estimate round in a kind of its own (estimate_compression), gradients and weights' change alike
    ("adamw/acco/int8/estimate-int4", "adamw", "acco", 2, "int8", 16, {"estimate_compression": "int4"}),
    ("sgd/acco/int8/estimate-int4-m4-block7", "sgd", "acco", 4, "int8", 7, {"estimate_compression": "int4"}),
    ("adamw/acco/int8/estimate-int4-gradients-only", "adamw", "acco", 2, "int8", 16,
     {"estimate_compression": "int4", "compression_weights": False}),
    ("sgd/acco/int4/estimate-int8", "sgd", "acco", 2, "int4", 16, {"estimate_compression": "int8"}),
    ("sgd/acco/int8/awc-estimate-int4", "sgd", "acco", 2, "int8", 16, {"awc": True, "estimate_compression": "int4"}),
    ("adamw/acco/int8/awc-clipped", "adamw", "acco", 2, "int8", 16, {"awc": True, "max_grad_norm": 0.05}),
]
# Mode acco with AdamW computes Opt* in functional.py, whose float operations round an ulp apart from torch's
# step (the oracle's) here and there; a quantizer turns an ulp across one of its boundaries into a whole
# quantum of that element's block. That happens at 3 ranks (one element, 4.4e-5 after 6 updates): those runs
# are compared at 2 ranks, and SGD with momentum (whose Opt* rounds as torch's step does) at every size.
WIDE = [c[0] for c in CONFIGS if not (c[1] == "adamw" and c[2] == "acco")]


def _worker(rank: int, world: int) -> dict:
    out = {}
    for name, opt_name, mode, m, kind, block, options in CONFIGS:
        if world > 2 and name not in WIDE:
            continue
        cls, kw = OPTIMIZERS[opt_name]
        model = make_model()
        theta0 = [p.detach().clone() for p in model.parameters()]
        options = dict(options)
        awc = options.pop("awc", False)
        loop = (dict(accumulate_while_communicating=True, min_microbatches=1, max_microbatches=1) if awc
                else dict(microbatches_per_update=m))
        opt = AccoOptimizer(model.parameters(), cls, mode=mode, compression=kind, compression_block=block,
                            estimate_extrapolation=1.0, **loop, **options, **kw)
        traj = []
        for t in range(UPDATES):
            for j in range(m):
                if awc:  # each micro-batch its own step(): the library averages the update's micro-batches
                    loss_fn(model, rank, t * m + j).backward()
                    opt.step()
                    opt.zero_grad()
                else:
                    (loss_fn(model, rank, t * m + j) / m).backward()
            if not awc:
                opt.step()
                opt.zero_grad()
            traj.append(flat(model))
        opt.finish()

        def scaled(r, i, w, m=m):
            return [g / m for g in grad_fn(r, i, w)]

        ref_steps, _, ref_final = update_run(
            theta0, lambda ps: cls(ps, **kw), mode, scaled, world, UPDATES, m,
            synchronous_updates=options.get("synchronous_updates", 0), max_grad_norm=options.get("max_grad_norm"),
            delay_correction=options.get("delay_correction", 0.0), compression=kind, compression_block=block,
            compression_weights=options.get("compression_weights", True),
            estimate_compression=options.get("estimate_compression"))
        if options.get("estimate_compression"):  # the estimate's own kind is in the path: not the commit's
            as_commit = update_run(
                theta0, lambda ps: cls(ps, **kw), mode, scaled, world, UPDATES, m, compression=kind,
                compression_block=block, compression_weights=options.get("compression_weights", True))[2]
            out[name + ":as-commit"] = rel_err(flat(model), flat_list(as_commit))
        exact = update_run(theta0, lambda ps: cls(ps, **kw), mode, scaled, world, UPDATES, m,
                           synchronous_updates=options.get("synchronous_updates", 0),
                           max_grad_norm=options.get("max_grad_norm"),
                           delay_correction=options.get("delay_correction", 0.0))[2]
        out[name] = {
            "step_err": max(rel_err(a, flat_list(b)) for a, b in zip(traj, ref_steps)),
            "final_err": rel_err(flat(model), flat_list(ref_final)),
            "vs_exact": rel_err(flat(model), flat_list(exact)),  # the compression's own effect: must be > 0
            "residual": opt.memory_report()["residual"],
        }
    return out


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_ranks(_worker, world, timeout=300)


@pytest.mark.parametrize("world,name", [(2, c[0]) for c in CONFIGS] + [
    pytest.param(w, n, marks=pytest.mark.slow) for w in (3, 4) for n in WIDE])
def test_compressed_rounds_equal_the_oracle(world, name):
    """Every rank's model after every step() equals the oracle's 8-bit transcription within 1e-5, and differs
    from the uncompressed run (the quantization is really in the path)."""
    for rank, results in enumerate(_results(world)):
        r = results[name]
        assert r["step_err"] < TOL and r["final_err"] < TOL, (rank, name, r)
        assert r["vs_exact"] > 1e-4, (rank, name, r)
        assert r["residual"] > 0, r
        if name + ":as-commit" in results:
            assert results[name + ":as-commit"] > 1e-5, (rank, name, results[name + ":as-commit"])


@pytest.mark.parametrize("kind,block", [("int8", 16), ("int8", 7), ("fp8", 16), ("fp8", 100), ("int4", 16),
                                        ("int4", 7)])
def test_the_quantizer_works_through_a_chunk_in_slabs_as_the_oracle_quantizes_it_whole(monkeypatch, kind, block):
    """Slabs of 64 elements (the library's are 2^18): a chunk of 3 slabs and a tail, a block of zeros among them,
    blocks that do not divide a slab; packed then unpacked, the change against a reference, the add into bf16
    weights and the residual are the oracle's whole-chunk transcription, bit for bit."""
    import acco.quantize as q
    from oracle import quantized

    monkeypatch.setattr(q, "SLAB", 64)
    n = 3 * 64 + 5
    g = torch.Generator().manual_seed(block)
    x, ref = torch.randn(n, generator=g) * 1e-2, torch.randn(n, generator=g) * 1e-2
    x[70:90] = 0.0
    packed = torch.empty(q.packed_size(n, block, kind), dtype=torch.uint8)
    q.quantize(x, kind, block, packed)
    assert torch.equal(q.dequantize(packed, kind, block, n), quantized(x, kind, block, 1))
    residual = torch.empty(n)
    q.residual_of(x, packed, kind, block, residual)
    assert torch.equal(residual, x - quantized(x, kind, block, 1))
    q.quantize(x, kind, block, packed, minus=ref)
    change = quantized(x - ref, kind, block, 1)
    assert torch.equal(q.dequantize(packed, kind, block, n), change)
    weights = ref.to(torch.bfloat16)
    q.dequantize_add_(packed, kind, block, n, weights)
    assert torch.equal(weights, (ref.to(torch.bfloat16).float() + change).to(torch.bfloat16))


def test_int4_packs_two_elements_a_byte():
    """A chunk of int4 carries half int8's payload bytes (its scales alike), and nibbles come back in order."""
    import acco.quantize as q

    assert q.packed_size(1024, 256, "int4") == 4 * 4 + 512 and q.packed_size(1024, 256, "int8") == 4 * 4 + 1024
    assert q.packed_size(7, 256, "int4") == 4 + 4  # 4 payload bytes (the last half full), padded to four
    x = torch.tensor([7.0, -7.0, 1.0, 0.0, -3.0])
    packed = torch.zeros(q.packed_size(5, 8, "int4"), dtype=torch.uint8)
    q.quantize(x, "int4", 8, packed)
    assert packed[4:7].tolist() == [15 | (1 << 4), 9 | (8 << 4), 5]
    assert torch.equal(q.dequantize(packed, "int4", 8, 5), x)


@pytest.mark.parametrize("options,error,words", [
    ({"compression": "int2"}, ValueError, "compression must be None, 'int8', 'fp8', 'int4' or 'auto'"),
    ({"compression": "int8", "compression_block": 0}, ValueError, "compression_block must be an int >= 1"),
    ({"compression": "int8", "compression_weights": 1}, TypeError, "compression_weights must be True or False"),
    ({"compression": "int8", "reduce_dtype": torch.bfloat16}, ValueError, "Drop reduce_dtype"),
    ({"compression": "int8", "estimate_dtype": torch.bfloat16}, ValueError, "Drop estimate_dtype"),
    ({"estimate_compression": "int4"}, ValueError, "under an explicit compression of the commit"),
    ({"compression": "auto", "estimate_compression": "int4"}, ValueError, "chooses both rounds' format"),
    ({"compression": "int8", "estimate_compression": "int2"}, ValueError, "estimate_compression must be None or one"),
    ({"compression": "int8", "estimate_compression": "int4", "mode": "dpu"}, ValueError, "applies to mode='acco' only"),
])
def test_compression_refuses_what_it_cannot_do(options, error, words):
    with pytest.raises(error, match=words):
        AccoOptimizer(make_model().parameters(), microbatches_per_update=2, lr=1e-2, **options)


def test_compression_on_one_process_keeps_its_residual_in_the_memory_report():
    """One process: the round still quantizes (the model differs from the uncompressed one), and
    memory_report() names the packed chunks and the residual (full size, the accumulation dtype)."""
    runs = {}
    for kind in (None, "int8"):
        model = make_model()
        opt = AccoOptimizer(model.parameters(), microbatches_per_update=2, compression=kind, lr=1e-2)
        for t in range(3):
            for j in range(2):
                (loss_fn(model, 0, 2 * t + j) / 2).backward()
            opt.step()
        opt.finish()
        runs[kind] = (flat(model), opt.memory_report(), opt.runtime.layout)
    (plain, plain_mem, _), (packed, mem, layout) = runs[None], runs["int8"]
    assert not torch.equal(plain, packed)
    assert mem["residual"] == layout.padded_numel * 4 and plain_mem["residual"] == 0
    assert mem["compressed"] > 0 and mem["library_total"] == plain_mem["library_total"] + mem["residual"] + mem["compressed"]


def _train(model, opt, rank, updates, start=0):
    out = []
    for t in range(start, start + updates):
        for j in range(2):
            (loss_fn(model, rank, 2 * t + j) / 2).backward()
        opt.step()
        opt.zero_grad()
        out.append(flat(model))
    return out


def _share_from_rank0(obj, path: str) -> None:
    """Rank 0 writes ``obj`` to ``path``; every rank returns once it is there (a barrier)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        torch.save(obj, path)
    dist.barrier()


def _resume_worker(rank: int, world: int, folder: str, mode: str) -> dict:
    """An uninterrupted compressed run against the same run stopped at update 3 and resumed into fresh objects,
    through opt.state_dict() (per rank) and through acco.checkpoint (DCP); and the residual each saved."""
    import acco.checkpoint

    estimate = mode.endswith("/e4")  # the estimate round in int4 (estimate_compression)
    mode = mode.split("/")[0]
    kw = dict(mode=mode, microbatches_per_update=2, compression="int8", compression_block=16, **KW)
    if estimate:
        kw["estimate_compression"] = "int4"
    model = make_model()
    opt = AccoOptimizer(model.parameters(), **kw)
    straight = _train(model, opt, rank, 6)
    opt.finish()
    out = {"straight": straight}
    for form in ("rank", "dcp", "gather"):
        model = make_model()
        opt = AccoOptimizer(model.parameters(), **kw)
        first = _train(model, opt, rank, 3)
        if form == "rank":
            saved = opt.state_dict()
        elif form == "gather":  # nanoGPT's form: one file, the committed model and every rank's shard
            gathered = acco.checkpoint.gather(opt, model=model)
            _share_from_rank0(gathered, f"{folder}/gathered.pt")
            saved = torch.load(f"{folder}/gathered.pt", weights_only=True)
        else:
            acco.checkpoint.save(f"{folder}/ck", opt, model=model)
        out[form + "_residual_moved"] = float(opt.runtime.flat.transport.residual.abs().max())  # round collected
        opt.finish()
        model = make_model(seed=1)  # other weights: the load puts the saved ones back
        opt = AccoOptimizer(model.parameters(), **kw)
        if form == "rank":
            opt.load_state_dict(saved, restore_model=True)
        elif form == "gather":  # the model first, then the optimizer's check that it is the saved one
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        else:
            acco.checkpoint.load(f"{folder}/ck", opt, model=model)
        out[form + "_residual_loaded"] = float(opt.runtime.flat.transport.residual.abs().max())
        out[form] = first + _train(model, opt, rank, 3, start=3)
        opt.finish()
    return out


@pytest.mark.parametrize("mode", ["acco", pytest.param("dpu", marks=pytest.mark.slow), "sync",
                                  pytest.param("acco/e4", marks=pytest.mark.slow)])
def test_a_compressed_run_resumes_bit_identically_with_its_residuals(tmp_path, mode):
    """Stopped after 3 updates and resumed into fresh objects, per rank (opt.state_dict()), through DCP
    (acco.checkpoint) and through one gathered file loaded model first (acco.checkpoint.gather: the model's
    committed weights are the int8-rebuilt ones, not the master, and the load accepts them), a compressed run goes on to the very same weights as the run that never stopped: the
    residuals (non-zero when saved) come back."""
    for rank, r in enumerate(run_ranks(_resume_worker, 2, str(tmp_path), mode, timeout=300)):
        for form in ("rank", "dcp", "gather"):
            assert r[form + "_residual_moved"] > 0 and r[form + "_residual_loaded"] == r[form + "_residual_moved"], r
            for u, (a, b) in enumerate(zip(r["straight"], r[form])):
                assert torch.equal(a, b), (rank, form, u, (a - b).abs().max())


def _reshard_worker(rank: int, world: int, folder: str) -> dict:
    import acco.checkpoint

    kw = dict(microbatches_per_update=2, compression="int8", compression_block=16, **KW)
    model = make_model()
    opt = AccoOptimizer(model.parameters(), **kw)
    if world == 2:
        _train(model, opt, rank, 3)
        acco.checkpoint.save(f"{folder}/ck", opt, model=model)
        opt.finish()
        return {}
    acco.checkpoint.load(f"{folder}/ck", opt, model=model)
    residual = float(opt.runtime.flat.transport.residual.abs().max())
    after = _train(model, opt, rank, 2, start=3)
    opt.finish()
    return {"residual": residual, "finite": all(bool(torch.isfinite(x).all()) for x in after), "updates": opt.num_updates}


def test_a_compressed_checkpoint_reshards_with_zero_residuals(tmp_path, caplog):
    """Saved on 2 ranks and loaded on 1 (DCP), the residuals start from zero (each was one rank's), the load says
    so, and training goes on."""
    run_ranks(_reshard_worker, 2, str(tmp_path), timeout=300)
    import logging

    with caplog.at_level(logging.INFO, logger="acco"):
        r = _reshard_worker(0, 1, str(tmp_path))
    assert r == {"residual": 0.0, "finite": True, "updates": 5}, r
    assert "written by 2 ranks, this run has 1: every rank starts from a zero residual" in caplog.text


def _skip_worker(rank: int, world: int) -> dict:
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="sync", microbatches_per_update=2, compression="int8",
                        compression_block=16, **KW)
    residuals = []
    for t in range(4):
        for j in range(2):
            loss = loss_fn(model, rank, 2 * t + j) / 2
            if t == 2 and rank == 1:
                loss = loss * float("inf")  # rank 1's sum is not finite in update 3
            loss.backward()
        opt.step()
        opt.zero_grad()
        residuals.append(opt.runtime.flat.transport.residual.clone())
    opt.finish()
    return {"skipped": opt.num_skipped_updates, "kept": torch.equal(residuals[1], residuals[2]),
            "moved": not torch.equal(residuals[2], residuals[3]), "finite": bool(torch.isfinite(flat(model)).all())}


def test_a_non_finite_gradient_skips_the_compressed_update_on_every_rank_and_keeps_the_residual():
    """An inf in one rank's sum comes back non-finite from its block (its scale is not finite), so every rank
    skips that update, and the skipped commit leaves each rank's residual as it was."""
    for rank, r in enumerate(run_ranks(_skip_worker, 2)):
        assert r == {"skipped": 1, "kept": True, "moved": True, "finite": True}, (rank, r)
