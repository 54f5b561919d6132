"""acco.probe: the update-time model (pure) and the command on 1 and 2 gloo ranks."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from _dist import run_command

from acco.probe import measure_round, parse_count, parse_matrix, predict, probe_parameters


def test_parse_count():
    """Check size suffixes and that bad sizes are refused with the value received."""
    assert parse_count("350M") == 350_000_000 and parse_count("1.3B") == 1_300_000_000
    assert parse_count("50000") == 50_000 and parse_count("2k") == 2_000
    for bad in ("", "-5", "0", "12 parsecs"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_count(bad)


@pytest.mark.parametrize(
    "compute,round_,k,sync,acco",
    [
        (1.0, 0.5, 1, 2.5, 2.0),  # round fits in half: acco = compute
        (1.0, 1.0, 1, 3.0, 2.0),  # round = half: still hidden
        (1.0, 2.0, 1, 4.0, 4.0),  # round = 2 halves: acco bound by 2 rounds
        (1.0, 2.0, 2, 6.0, 4.0),  # two micro-batches per half hide it again
    ],
)
def test_predict_is_the_documented_model(compute, round_, k, sync, acco):
    """Check sync = 2kT + R and acco = max(2kT, 2R) per update."""
    p = predict(compute, round_, k)
    assert p.sync_update_s == pytest.approx(sync) and p.acco_update_s == pytest.approx(acco)
    assert p.speedup == pytest.approx(sync / acco)


def test_predict_recommendations():
    """Check the advice: negligible communication, hidden, and how many micro-batches hide a long round."""
    assert "within 5%" in predict(1.0, 0.05).recommendation
    assert "hides each round" in predict(1.0, 0.8).recommendation and predict(1.0, 0.8).hidden == 1.0
    slow = predict(1.0, 2.5)
    assert slow.recommended_microbatches_per_half == 3 and "microbatches_per_update=6" in slow.recommendation
    assert slow.hidden == pytest.approx(0.4)
    with pytest.raises(ValueError, match="compute_s > 0"):
        predict(0.0, 1.0)


def _probe(*args: str, ranks: int) -> dict:
    if ranks == 1:
        cmd = [sys.executable, "-m", "acco.probe", *args, "--json"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               "-m", "acco.probe", *args, "--json"]
    out = run_command(cmd, timeout=120)
    line = next(line for line in out.splitlines() if line.startswith("{"))
    return json.loads(line)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.slow
def test_probe_command_measures_rounds(ranks):
    """Check that the probe times real rounds and applies the model to them."""
    r = _probe("--params", "200k", "--compute-seconds", "0.05", "--rounds", "3", ranks=ranks)
    assert r["ranks"] == ranks and r["params"] == 200_000 and r["compute_source"] == "given"
    assert r["round_s"] > 0
    assert r["sync_update_s"] == pytest.approx(0.1 + r["round_s"])
    assert r["acco_update_s"] == pytest.approx(max(0.1, 2 * r["round_s"]))


@pytest.mark.slow
def test_probe_estimates_compute_from_tokens():
    """Check the estimate path: 6 x params x tokens over measured matmul FLOP/s."""
    r = _probe("--params", "100k", "--tokens", "4k", "--rounds", "2", ranks=1)
    assert r["compute_source"].startswith("estimated") and r["compute_half_s"] > 0


def test_probe_refuses_missing_compute():
    """Check that without --compute-seconds or --tokens the probe says what to give."""
    with pytest.raises(AssertionError, match="give --compute-seconds"):
        run_command([sys.executable, "-m", "acco.probe", "--params", "1M"], timeout=60)


@pytest.mark.slow
def test_probe_with_muon_steps_whole_matrices():
    """Check --optimizer muon times rounds of torch.optim.Muon on whole matrices of the given shape (Muon refuses
    anything but 2-D, so a flat slice would fail), on 2 ranks, and that its options are checked."""
    assert parse_matrix("768x3072") == (768, 3072) and parse_matrix(" 64 X 32 ") == (64, 32)
    with pytest.raises(ValueError, match="such as 768x3072.*got '768'"):
        parse_matrix("768")
    assert [tuple(p.shape) for p in probe_parameters(200_000, torch.float32, torch.device("meta"), (128, 128))] \
        == [(128, 128)] * 12
    assert measure_round(20_000, torch.float32, torch.device("cpu"), rounds=1, warmup=0,
                         optimizer_class=torch.optim.Muon, matrix=(32, 64)) > 0
    r = _probe("--params", "20k", "--optimizer", "muon", "--matrix", "32x32", "--compute-seconds", "0.05",
               "--rounds", "2", ranks=2)
    assert r["stepped"] == "Muon on 20 whole 32x32 matrices (0.0M elements)" and r["round_s"] > 0
    with pytest.raises(AssertionError, match="--optimizer muon needs --matrix"):
        run_command([sys.executable, "-m", "acco.probe", "--params", "1M", "--optimizer", "muon",
                     "--compute-seconds", "0.1"], timeout=60)


@pytest.mark.slow
def test_probe_with_compression_times_compressed_rounds_too(monkeypatch):
    """Check --compression int8: the probe also times rounds that really are compressed (the all-to-all of
    packed chunks runs), predicts acco with them, and compares that with sync ZeRO-1's full-width rounds."""
    import acco.compressed

    calls = []
    original = acco.compressed.reduce_scatter_packed
    monkeypatch.setattr(acco.compressed, "reduce_scatter_packed", lambda *a, **k: calls.append(1) or original(*a, **k))
    assert measure_round(20_000, torch.float32, torch.device("cpu"), rounds=2, warmup=1, compression="int8") > 0
    assert len(calls) == 3
    r = _probe("--params", "200k", "--compute-seconds", "0.05", "--rounds", "3", "--compression", "int8", ranks=2)
    c = r["compressed"]
    assert r["compression"] == "int8" and c["round_s"] > 0
    assert c["acco_update_s"] == pytest.approx(max(0.1, 2 * c["round_s"]))
    assert c["speedup"] == pytest.approx(r["sync_update_s"] / c["acco_update_s"])
    assert c["vs_acco"] == pytest.approx(r["acco_update_s"] / c["acco_update_s"])
