"""A compressed run's saved error-feedback residuals are taken only when they are this run's (issue 78, items 3
and 4): a DCP checkpoint that lacks one rank's residual, and a residual of another size or holding NaN, are
refused on every rank before anything changes. Before, each loaded with that rank's residual zeroed (or, with a
NaN, every later update skipped), and without a word but a log line."""

from __future__ import annotations

import pickle

import pytest
import torch

from _dist import run_ranks

from acco import AccoOptimizer, CheckpointError
from acco.state.checksums import checksums
from acco.state.format import encode_meta

KW = dict(microbatches_per_update=2, compression="int8", compression_block=16, lr=1e-2)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _train(model, opt, rank: int, updates: int) -> None:
    for t in range(updates):
        for j in range(2):
            g = torch.Generator().manual_seed(100 * rank + 10 * t + j)
            (model(torch.randn(5, 6, generator=g)).pow(2).mean() / 2).backward()
        opt.step()
        opt.zero_grad()


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _drop_from_metadata(path: str, key: str) -> None:
    """The checkpoint as if ``key``'s entry had never been written (its checksum stays listed)."""
    meta_path = f"{path}/.metadata"
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    del meta.state_dict_metadata[key]
    meta.storage_data = {k: v for k, v in meta.storage_data.items() if k.fqn != key}
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)


def _missing_worker(rank: int, world: int, folder: str) -> dict:
    import acco.checkpoint

    model = _model()
    opt = AccoOptimizer(model.parameters(), **KW)
    _train(model, opt, rank, 3)
    acco.checkpoint.save(f"{folder}/ck", opt, model=model)
    opt.finish()
    torch.distributed.barrier()
    if rank == 0:
        _drop_from_metadata(f"{folder}/ck", "optim.residual.r1")
    torch.distributed.barrier()
    model = _model()
    opt = AccoOptimizer(model.parameters(), **KW)
    _train(model, opt, rank, 1)
    before = _weights(model)
    try:
        acco.checkpoint.load(f"{folder}/ck", opt, model=model)
    except CheckpointError as exc:
        error = str(exc)
    else:
        error = None
    unchanged = torch.equal(before, _weights(model)) and opt.num_updates == 1
    _train(model, opt, rank, 1)  # the optimizer goes on as it was: the refusal left every rank in step
    opt.finish()
    return {"error": error, "unchanged": unchanged}


def test_a_checkpoint_missing_one_ranks_residual_is_refused_on_every_rank(tmp_path):
    for r in run_ranks(_missing_worker, 2, str(tmp_path), timeout=300):
        assert r["error"] is not None and "those of rank(s) [1] are not in it" in r["error"], r
        assert "Nothing was loaded" in r["error"] and r["unchanged"], r


def _edited_worker(rank: int, world: int, how: str) -> dict:
    model = _model()
    opt = AccoOptimizer(model.parameters(), **KW)
    _train(model, opt, rank, 3)
    sd = dict(opt.state_dict())
    residual = sd["residual"]
    if how == "nan":
        residual = residual.clone()
        residual[3] = float("nan")
    else:
        residual = residual[:-1].clone()
    sd["residual"] = residual
    body = {k: v for k, v in sd.items() if k not in ("acco", "checksums")}
    sd["checksums"] = checksums({"optim": body, "meta": encode_meta(sd["acco"])})  # a deliberate edit
    before = _weights(model)
    try:
        opt.load_state_dict(sd)
    except CheckpointError as exc:
        error = str(exc)
    else:
        error = None
    unchanged = torch.equal(before, _weights(model))
    _train(model, opt, rank, 1)
    opt.finish()
    return {"error": error, "unchanged": unchanged, "skipped": opt.num_skipped_updates}


@pytest.mark.parametrize("how,words", [("nan", "holds inf or NaN"), ("shape", "has shape")])
def test_an_edited_residual_is_refused_on_every_rank(how, words):
    """A residual re-checksummed after an edit: a NaN inside (every later update would skip) or another size
    (it was set to zero) is refused, each rank naming it, and training goes on unchanged."""
    for r in run_ranks(_edited_worker, 2, how, timeout=300):
        assert r["error"] is not None and words in r["error"] and "Nothing was loaded" in r["error"], r
        assert r["unchanged"] and r["skipped"] == 0, r


def _one_rank_reads_damage_worker(rank: int, world: int, folder: str) -> dict:
    """Rank 1's master piece damaged in the newer checkpoint: only rank 1 reads it."""
    import glob

    import acco.checkpoint

    model = _model()
    opt = AccoOptimizer(model.parameters(), **KW)
    _train(model, opt, rank, 2)
    acco.checkpoint.save(f"{folder}/good", opt, model=model)
    _train(model, opt, rank, 1)
    acco.checkpoint.save(f"{folder}/damaged", opt, model=model)
    needle = opt.runtime.flat.master[:4].numpy().tobytes()  # this rank's master slice (its first piece), as stored
    opt.finish()
    torch.distributed.barrier()
    if rank == 1:
        for name in glob.glob(f"{folder}/damaged/*.distcp"):
            data = bytearray(open(name, "rb").read())
            at = bytes(data).find(needle)
            if at >= 0:
                data[at + 5] ^= 0x40
                open(name, "wb").write(data)
                break
        else:
            raise AssertionError("rank 1's master slice must be found for the test to mean anything")
    torch.distributed.barrier()
    model = _model()
    opt = AccoOptimizer(model.parameters(), **KW)
    try:
        acco.checkpoint.load(f"{folder}/damaged", opt, model=model)
        error = None
    except CheckpointError as exc:  # what a script does: on every rank, fall back to the previous checkpoint
        error = str(exc)
        acco.checkpoint.load(f"{folder}/good", opt, model=model)
    _train(model, opt, rank, 1)
    opt.finish()
    return {"error": error, "updates": opt.num_updates}


def test_damage_one_rank_reads_is_refused_on_every_rank_and_an_earlier_checkpoint_loads(tmp_path):
    """A damaged entry that only rank 1 reads: every rank raises CheckpointError before anything changes (only
    rank 1 did, and the other rank's fallback load then met it in another call), and every rank's fallback to
    the previous checkpoint loads."""
    r0, r1 = run_ranks(_one_rank_reads_damage_worker, 2, str(tmp_path), timeout=300)
    assert r1["error"] is not None and "does not match its checksum" in r1["error"], r1
    assert r0["error"] is not None and "rank(s) [1] found what they read damaged" in r0["error"], r0
    assert r0["updates"] == r1["updates"] == 3, (r0, r1)


CHANGES = {  # the saving run's settings -> the resuming run's
    "int8 -> none": ({"compression": "int8"}, {"compression": None, "estimate_dtype": None}),
    "int8 -> fp8": ({"compression": "int8"}, {"compression": "fp8"}),
    "block 16 -> 4": ({"compression": "int8", "compression_block": 16}, {"compression": "int8", "compression_block": 4}),
    "weights -> exact": ({"compression": "int8"}, {"compression": "int8", "compression_weights": False}),
    "none -> int8": ({"compression": None, "estimate_dtype": None}, {"compression": "int8"}),
}


def _changed_settings_worker(rank: int, world: int, folder: str, change: str) -> dict:
    import acco.checkpoint

    before, after = CHANGES[change]
    base = dict(microbatches_per_update=2, lr=1e-2, compression_block=16)
    model = _model()
    opt = AccoOptimizer(model.parameters(), **{**base, **before})
    _train(model, opt, rank, 3)
    with opt.committed_weights():
        committed = _weights(model)
    saved = opt.state_dict()
    acco.checkpoint.save(f"{folder}/ck", opt, model=model)
    gathered = acco.checkpoint.gather(opt, model=model)  # on rank 0; one file every rank reads
    if rank == 0:
        torch.save(gathered, f"{folder}/gathered.pt")
    opt.finish()
    torch.distributed.barrier()
    gathered = torch.load(f"{folder}/gathered.pt", weights_only=True)
    out = {}
    for form in ("rank", "gather", "dcp"):
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # other weights: the load puts the saved ones back
        opt = AccoOptimizer(model.parameters(), **{**base, **after})
        if form == "rank":
            with torch.no_grad():  # the model saved with it, as a script loads it before the optimizer
                for p, w in zip(model.parameters(), _split(committed, model)):
                    p.copy_(w)
            opt.load_state_dict(saved)
        elif form == "gather":
            model.load_state_dict(gathered["model"])
            opt.load_state_dict(gathered["optimizer"])
        else:
            acco.checkpoint.load(f"{folder}/ck", opt, model=model)
        with opt.committed_weights():
            out[form] = float((_weights(model) - committed).abs().max())
        _train(model, opt, rank, 2)
        opt.finish()
        out[form + "_finite"] = bool(torch.isfinite(_weights(model)).all()) and opt.num_updates == 5
    return out


def _split(flat: torch.Tensor, model) -> list:
    out, at = [], 0
    for p in model.parameters():
        out.append(flat[at:at + p.numel()].view_as(p))
        at += p.numel()
    return out


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_compressed_run_resumes_with_other_compression_settings(tmp_path, change):
    """Mode acco, 2 ranks: a state saved with one compression setting resumes under another from a rank file, a
    gathered file and DCP, the model it was saved with accepted (its committed weights are rebuilt as the saving
    run's round sent them, recorded in the state's description), the committed weights after the load equal to
    the saving run's bit for bit, and training goes on. It was refused as "a model from another checkpoint"
    in the per-rank forms."""
    for r in run_ranks(_changed_settings_worker, 2, str(tmp_path), change, timeout=300):
        for form in ("rank", "gather", "dcp"):
            assert r[form] == 0.0 and r[form + "_finite"], (form, r)
