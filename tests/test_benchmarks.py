"""Smoke tests: every benchmark script runs for one tiny point on loopback (no namespaces).

These check that the scripts work and write complete records; the numbers are
measured by running the scripts themselves (docs/benchmarks.md), not here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import run_command

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))


def _records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_overlap_and_report_smoke(tmp_path):
    """Check overlap.py writes one record per method with tokens/s, utilisation and round statistics,
    and report.py turns them into tables and a plot."""
    out = tmp_path / "overlap.jsonl"
    methods = "compute,acco,sync,ddp-zero"  # acco:ring0 and dpu are the same worker with another flag/mode
    run_command([sys.executable, str(BENCH / "overlap.py"), "--loopback", "--smoke", "--methods", methods,
                 "--out", str(out)], timeout=300)
    recs = {r["label"]: r for r in _records(out)}
    assert list(recs) == methods.split(",")
    assert all(r["tokens_per_s"] > 0 and r["microbatches"] > 0 for r in recs.values())
    assert recs["compute"]["utilisation"] == 1.0
    for label in ("acco", "sync"):
        s = recs[label]["summary"]
        assert s["rounds"] > 0 and s["round_s"] > 0 and len(s["microbatches_per_rank"]) == 2
    # equal tokens per update: 2 micro-batches per rank, timed updates only
    assert recs["acco"]["microbatches"] == recs["sync"]["microbatches"] == recs["ddp-zero"]["microbatches"] == 8
    plot = tmp_path / "overlap.png"
    report = run_command([sys.executable, str(BENCH / "report.py"), str(out), "--plot", str(plot)], timeout=120)
    assert "| acco |" in report or "acco" in report
    assert plot.stat().st_size > 0


def test_hetero_smoke(tmp_path):
    """Check hetero.py: the slowed rank contributes fewer micro-batches per round to acco-acc."""
    out = tmp_path / "hetero.jsonl"
    run_command([sys.executable, str(BENCH / "hetero.py"), "--loopback", "--smoke", "--methods",
                 "compute,acco-acc,sync", "--out", str(out)], timeout=300)
    recs = {r["label"]: r for r in _records(out)}
    assert set(recs) == {"compute", "acco-acc", "sync"}
    assert all(r["slow_rank"] == 1 and r["tag"] == "hetero" for r in recs.values())
    fast, slow = recs["acco-acc"]["summary"]["microbatches_per_rank"]
    assert fast >= slow
    report = run_command([sys.executable, str(BENCH / "report.py"), str(out)], timeout=60)
    assert "Heterogeneous" in report


def test_memory_smoke(tmp_path):
    """Check memory.py records peak RSS for each method and the buffers of acco and DDP+ZeRO."""
    out = tmp_path / "memory.jsonl"
    run_command([sys.executable, str(BENCH / "memory.py"), "--smoke", "--methods", "compute,acco,ddp-zero",
                 "--out", str(out)], timeout=300)
    recs = {r["label"]: r for r in _records(out)}
    assert all(len(r["peak_rss_bytes"]) == 2 and min(r["peak_rss_bytes"]) > 0 for r in recs.values())
    assert recs["acco"]["memory"]["library_total"] > 0
    assert recs["ddp-zero"]["memory"]["optimizer_state"] > 0


def test_netns_dry_run_prints_a_rate_limited_testbed():
    """Check the testbed's commands: a namespace per rank, MTU 9000, tbf on both ends of every link."""
    out = subprocess.run([sys.executable, str(BENCH / "netns.py"), "up", "--ranks", "3", "--rate-mbit", "100",
                          "--dry-run"], capture_output=True, text=True, check=True).stdout
    for r in range(3):
        assert f"ip netns add acco-r{r}" in out and f"10.77.0.{r + 1}/24" in out
    assert out.count("tbf rate 100.0mbit") == 6
    assert "mtu 9000" in out
    assert all(ns.startswith("acco-") for ns in [line.split()[3] for line in out.splitlines() if " netns add " in line])


def test_netns_and_benchmarks_say_they_need_root(monkeypatch):
    """Check that without root the testbed and the sweep stop with a message saying so."""
    import netns
    import overlap

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="must run as root"):
        netns.main(["up", "--ranks", "2"])
    monkeypatch.setattr(overlap.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="run it as root, or pass --loopback"):
        overlap.main(["--rates", "100"])


def test_collectives_smoke(tmp_path):
    """Check collectives.py times every case on 2 ranks and writes them."""
    out = tmp_path / "collectives.json"
    run_command([sys.executable, str(BENCH / "collectives.py"), "--loopback", "--numel", "40000", "--repeats", "1",
                 "--out", str(out)], timeout=120)
    rec = json.loads(out.read_text())
    for case in ("reduce_scatter gloo", "reduce_scatter ring", "all_gather gloo", "all_gather ring", "send 1/N one way"):
        assert rec[case] > 0


def test_gpu_check_dry_run(tmp_path):
    """benchmarks/gpu_check.py, the GPU acceptance, runs end to end on CPU and writes every section; the
    compile check finds no recompiles from the swaps; the trace analysis works on its synthetic trace."""
    out = tmp_path / "gpu.md"
    out.write_text("# kept\n\n<!-- gpu_check:begin -->\nold\n<!-- gpu_check:end -->\n\n## after\n")
    run_command([sys.executable, str(BENCH / "gpu_check.py"), "--dry-run", "--out", str(out)], timeout=300)
    text = out.read_text()
    assert text.startswith("# kept") and text.rstrip().endswith("## after") and "\nold\n" not in text
    assert "Dry run on CPU" in text
    for section in ("### 1. CUDA tests", "### 2. Profiler trace", "### 3. Per-update time", "### 4. torch.compile",
                    "### 5. Memory"):
        assert section in text, section
    assert "exit 0" in text and "skipped" in text
    assert "no recompiles" in text
    assert "'overlap': {13: 0.7857142857142857}" in text  # 110 of the side stream's 140 us under compute kernels


def test_trace_analysis_counts_overlap_and_host_syncs():
    import gpu_check

    events = [
        {"ph": "X", "cat": "kernel", "ts": 0, "dur": 10, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "ts": 5, "dur": 10, "args": {"stream": 20}},  # half under compute
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 0, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 2, "dur": 1},
    ]
    r = gpu_check.analyze_trace(events, updates=2)
    assert r["compute_stream"] == 7 and r["overlap"] == {20: 0.5}
    assert r["host_syncs_per_update"] == {"cudaStreamSynchronize": 1.0}
