"""Smoke tests: every benchmark script runs for one tiny point on loopback (no namespaces).

These check that the scripts work and write complete records; the numbers are
measured by running the scripts themselves (docs/benchmarks.md), not here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import run_command

pytestmark = pytest.mark.slow  # make test-all only: every benchmark's smoke launch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))


def _records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _ratio_cell(values) -> str:
    """The report's ``median [min–max]`` cell, computed here from the per-repeat values."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}–{max(values):.2f}]"


def _table(report: str, column: str) -> list:
    """The rows, as {header: cell}, of the first markdown table whose header has ``column``."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and column in line)
    head = [c.strip() for c in lines[start].strip().strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(head, [c.strip() for c in line.strip().strip("|").split("|")])))
    return rows


def test_overlap_and_report_smoke(tmp_path):
    """Check overlap.py runs every method once per repeat, interleaved (A B C A B C), with equal tokens per
    update, torch DDP stepping the whole model and DDP+ZeRO a shard, and report.py's ratio table takes
    acco / best of (ddp, ddp-zero) per repeat."""
    out = tmp_path / "overlap.jsonl"
    methods = ["acco", "ddp", "ddp-zero"]  # compute, sync and the awc loop's bounds: test_hetero_smoke
    run_command([sys.executable, str(BENCH / "overlap.py"), "--loopback", "--smoke", "--repeats", "2",
                 "--methods", ",".join(methods), "--out", str(out)], timeout=300)
    recs = _records(out)
    assert [(r["label"], r["repeat"]) for r in recs] == [(m, k) for k in range(2) for m in methods]
    assert all(r["tokens_per_s"] > 0 and r["dtype"] == "fp32" and r["loop"] == "awc" for r in recs)
    # equal tokens per update: 2 micro-batches per rank, timed updates only
    assert {r["microbatches"] for r in recs} == {8}
    acco = recs[0]
    assert acco["summary"]["rounds"] > 0 and len(acco["summary"]["microbatches_per_rank"]) == 2
    assert acco["options"]["accumulate_while_communicating"] == "True"  # the awc loop
    assert {x["local_microbatches"] for x in acco["rounds"] if x["kind"] == "estimate"} == {1}  # one per half
    ddp, zero = recs[1]["memory"], recs[2]["memory"]
    # torch DDP: AdamW state of the whole model on every rank; ZeRO: of the parameters this rank owns
    assert ddp["optimizer_state"] >= 2 * recs[1]["param_bytes_fp32"] > zero["optimizer_state"] > 0
    assert ddp["ddp_buckets"] == ddp["params"] == recs[1]["param_bytes_fp32"]
    report = run_command([sys.executable, str(BENCH / "report.py"), str(out)], timeout=120)
    tokens = {(r["label"], r["repeat"]): r["tokens_per_s"] for r in recs}
    best = [tokens["acco", k] / max(tokens["ddp", k], tokens["ddp-zero", k]) for k in range(2)]
    [row] = _table(report, "acco / best of")
    assert row["acco / best of (ddp, ddp-zero)"] == _ratio_cell(best)
    assert row["acco / ddp"] == _ratio_cell([tokens["acco", k] / tokens["ddp", k] for k in range(2)])


def test_mesh_memory_smoke(tmp_path):
    """benchmarks/mesh_memory.py runs its three methods on a (2, 2) mesh under torchrun and prints a row each."""
    out = run_command([sys.executable, str(BENCH / "mesh_memory.py"), "--smoke", "--out", str(tmp_path / "m.jsonl")],
                      timeout=600)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert sorted({r["method"] for r in rows}) == ["acco", "fsdp2-acco", "hsdp-adamw"] and len(rows) == 12
    assert all(r["peak_rss"] > 0 and r["expected"] > 0 for r in rows)
    for method in ("| hsdp-adamw |", "| fsdp2-acco |", "| acco |"):
        assert method in out, out


def test_mesh_speed_smoke(tmp_path):
    """benchmarks/mesh_speed.py runs both methods on a (2, 2) mesh on loopback and prints their ratio."""
    out = run_command([sys.executable, str(BENCH / "mesh_speed.py"), "--smoke", "--out", str(tmp_path / "s.jsonl")],
                      timeout=600)
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["hsdp-adamw", "fsdp2-acco"] and all(r["tokens_per_s"] > 0 for r in rows)
    assert "fsdp2-acco / hsdp-adamw tokens/s: median" in out, out


def test_regions_speed_smoke(tmp_path):
    """benchmarks/regions_speed.py runs every method it compares on two regions of two ranks on loopback, records
    the outer state's bytes, and prints each method's tokens/s against compute-only."""
    out = run_command([sys.executable, str(BENCH / "regions_speed.py"), "--smoke", "--out", str(tmp_path / "s.jsonl")],
                      timeout=600)
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["compute-only", "region-only", "ddp", "acco-int8", "regions-h10"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    outer = next(r for r in rows if r["method"] == "regions-h10")
    assert outer["updates"] == 60 and outer["outer_bytes"] > outer["master_bytes"] > 0, outer
    assert "regions-h10 / compute-only tokens/s: median" in out, out


def test_torchtitan_speed_smoke(tmp_path):
    """benchmarks/torchtitan_speed.py runs torchtitan's HSDP and torchtitan + ACCO on 4 ranks on loopback, reads
    torchtitan's own tps from its log and prints their ratio."""
    from extras import available

    if not available("torchtitan", "torchtitan"):
        pytest.skip("needs torchtitan (pip install -e '.[torchtitan]')")
    out = run_command([sys.executable, str(BENCH / "torchtitan_speed.py"), "--smoke", "--assets",
                       str(tmp_path / "assets"), "--out", str(tmp_path / "s.jsonl")], timeout=900)
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["hsdp", "acco"] and all(r["tokens_per_s"] > 0 for r in rows), rows
    assert all(r["steps"] == 4 for r in rows) and "acco / hsdp tokens/s: median" in out, out


@pytest.mark.parametrize("methods,words", [("acco", "hsdp missing"), ("hsdp,acco-fp4", "unknown acco-fp4")])
def test_torchtitan_speed_refuses_methods_it_cannot_compare(methods, words):
    """--methods names torchtitan_speed.py's methods, hsdp among them (every ratio is against it); anything else
    stops before any run, saying what was received."""
    proc = subprocess.run([sys.executable, str(BENCH / "torchtitan_speed.py"), "--methods", methods],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and words in proc.stderr and "hsdp, acco, acco-int8" in proc.stderr, proc.stderr


def test_hetero_smoke(tmp_path):
    """Check hetero.py: the slowed rank contributes fewer micro-batches per round to acco-acc."""
    out = tmp_path / "hetero.jsonl"
    # rank 1 8x slower, not the script's 2x, so that other load on the CPU cannot make the unslowed rank the slower
    # one (beside another test file it once did: 2.0 against 2.25 micro-batches per round)
    run_command([sys.executable, str(BENCH / "hetero.py"), "--loopback", "--smoke", "--repeats", "1", "--methods",
                 "compute,acco-acc,sync", "--slow-factor", "8", "--out", str(out)], timeout=300)
    recs = {r["label"]: r for r in _records(out)}
    assert list(recs) == ["compute", "acco-acc", "sync"]
    assert all(r["slow_rank"] == 1 and r["tag"] == "hetero" and r["repeat"] == 0 for r in recs.values())
    assert all(r["slow_factor"] == 8 for r in recs.values())
    assert recs["compute"]["utilisation"] == 1.0 and 0 < recs["sync"]["utilisation"]
    assert recs["sync"]["summary"]["rounds"] > 0 and recs["sync"]["microbatches"] == 8
    fast, slow = recs["acco-acc"]["summary"]["microbatches_per_rank"]
    assert fast >= slow
    report = run_command([sys.executable, str(BENCH / "report.py"), str(out)], timeout=60)
    assert "Heterogeneous" in report
    assert [r["method"] for r in _table(report, "vs best of")] == ["compute", "acco-acc", "sync"]


def test_memory_smoke(tmp_path):
    """Check memory.py in bf16: the library's default loop with a bf16 compute copy and fp32 accumulation,
    torch DDP+ZeRO in pure bf16 and under autocast (fp32 parameters), every rank's peak RSS, and the report's
    target table against both torch baselines."""
    out = tmp_path / "memory.jsonl"
    run_command([sys.executable, str(BENCH / "memory.py"), "--smoke", "--ranks", "2", "--dtypes", "bf16",
                 "--repeats", "1", "--methods", "acco,ddp-zero", "--out", str(out)], timeout=300)
    recs = {r["label"]: r for r in _records(out)}
    assert list(recs) == ["acco", "ddp-zero", "ddp-zero-amp"]
    assert all(len(r["peak_rss_bytes"]) == 2 and min(r["peak_rss_bytes"]) > 0 for r in recs.values())
    assert all(r["ranks"] == 2 and r["point_dtype"] == "bf16" and r["loop"] == "update" for r in recs.values())
    acco, zero, amp = recs["acco"], recs["ddp-zero"], recs["ddp-zero-amp"]
    assert (acco["dtype"], zero["dtype"], amp["dtype"]) == ("bf16", "bf16", "amp")
    numel = acco["params"]
    assert acco["param_bytes_compute"] == 2 * numel and acco["param_bytes_fp32"] == 4 * numel
    assert acco["memory"]["params"] == zero["memory"]["params"] == 2 * numel  # bf16 copies of the model
    assert acco["memory"]["accum"] >= 4 * numel  # summed in fp32
    assert amp["memory"]["params"] == 4 * numel  # autocast: fp32 parameters
    assert acco["options"] == {"mode": "acco", "accumulate_while_communicating": "False",  # the default loop
                               "microbatches_per_update": "2", "compute_dtype": "torch.bfloat16",
                               "accumulation_dtype": "torch.float32", "reduce_dtype": "torch.float32",
                               "estimate_dtype": "None", "estimate_extrapolation": "1.2",  # AdamW: "auto" is 1.2
                               "delay_correction": "0.0",  # mode dpu's option, recorded for every method
                               "compression_in_use": "None"}  # the rounds' format (compression="auto" chooses it)
    # one timed update: the estimate round carries its first micro-batch, the commit round both
    assert [(x["kind"], x["local_microbatches"]) for x in acco["rounds"]] == [("estimate", 1), ("commit", 2)]
    assert acco["microbatches"] == 4 and acco["tokens_per_s"] > 0
    report = run_command([sys.executable, str(BENCH / "report.py"), str(out)], timeout=60)
    assert [r["method"] for r in _table(report, "peak RSS MiB")] == ["acco", "ddp-zero", "ddp-zero-amp"]
    assert [(r["method"], r["against"]) for r in _table(report, "in fp32 copies")] == [
        ("acco", "ddp-zero"), ("acco", "ddp-zero-amp")]
    assert "above compute-only" not in report  # no compute-only run: no column of blanks
    # with a compute-only run (here the acco record relabelled, its peaks lowered by 1 MiB), the column is there
    compute = dict(acco, label="compute", method="compute", peak_rss_bytes=[b - 2**20 for b in acco["peak_rss_bytes"]])
    with open(out, "a") as f:
        f.write(json.dumps(compute) + "\n")
    report = run_command([sys.executable, str(BENCH / "report.py"), str(out)], timeout=60)
    above = {r["method"]: r["above compute-only MiB"] for r in _table(report, "peak RSS MiB")}
    assert above["acco"] == "1" and above["compute"] == "0", above  # one repeat: a median alone


def test_report_takes_ratios_per_repeat(tmp_path):
    """Check report.py on records with known numbers: ratios within a repeat, then median and range (not a ratio
    of medians), the best of the two torch baselines chosen per repeat, utilisation over the same repeat's
    compute-only run, memory in parameter-sized copies, a record without ``repeat`` read as repeat 0, the plot."""
    import report

    common = dict(world=2, micro_batch=2, seq_len=10, params=1000, rate_mbit=100.0)
    tokens = {"compute": [100, 200, 100], "acco": [90, 100, 80], "sync": [60, 100, 50],
              "ddp": [50, 80, 20], "ddp-zero": [40, 90, 30]}
    recs = [dict(common, tag="overlap", label=m, repeat=k, tokens_per_s=t[k],
                 summary={"rounds": 4, "round_s": 0.1, "hidden": 1.0} if m in ("acco", "sync") else {})
            for k in range(3) for m, t in tokens.items()]
    mem = {"acco": [11000, 13000], "ddp-zero": [9000, 10000]}  # peak RSS per rank, bytes
    recs += [dict(common, tag="memory", label=m, repeat=0, peak_rss_bytes=rss, point_dtype="bf16", dtype="bf16")
             for m, rss in mem.items()]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    old = tmp_path / "old.jsonl"  # a record of the first sweep: no repeat, dtype or loop
    old.write_text(json.dumps(dict(common, tag="overlap", label="acco", rate_mbit=50.0, tokens_per_s=7.0)))
    rec = {(r["label"], r["repeat"]): r["tokens_per_s"] for r in recs if r["tag"] == "overlap"}

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report.main([str(path), str(old), "--plot", str(tmp_path / "u.png")])
    text = out.getvalue()
    best = [rec["acco", k] / max(rec["ddp", k], rec["ddp-zero", k]) for k in range(3)]
    assert best == [90 / 50, 100 / 90, 80 / 30]
    ratio = {r["rate Mbit/s"]: r for r in _table(text, "acco / best of")}
    x = [0.1 / (2 * 2 * 10 / rec["compute", k]) for k in range(3)]  # T_round(sync) / T_half(compute) per repeat
    assert ratio["100"]["x"] == _ratio_cell(x)
    for col, den in (("acco / ddp-zero", "ddp-zero"), ("acco / ddp", "ddp"), ("acco / sync", "sync")):
        assert ratio["100"][col] == _ratio_cell([rec["acco", k] / rec[den, k] for k in range(3)]), col
    assert ratio["100"]["acco / best of (ddp, ddp-zero)"] == _ratio_cell(best)
    rows = {(r["rate Mbit/s"], r["method"]): r for r in _table(text, "utilisation")}
    assert rows["100", "acco"]["utilisation"] == "0.800 [0.500–0.900]"  # 90/100, 100/200, 80/100
    for label in ("sync", "ddp-zero"):  # each method against DDP and ACCO, per repeat; none against itself
        for col, den in (("vs ddp", "ddp"), ("vs acco", "acco")):
            assert rows["100", label][col] == _ratio_cell([rec[label, k] / rec[den, k] for k in range(3)]), (label, col)
    assert rows["100", "ddp"]["vs ddp"] == "" and rows["100", "acco"]["vs acco"] == ""
    assert rows["50", "acco"]["vs ddp"] == ""  # the old record's point has no DDP run
    assert rows["50", "acco"]["tokens/s"] == "7"  # the old record, as one repeat
    # acco's peak 13000 B vs ddp-zero's 10000 B: 0.75 fp32 copies (4000 B), 1.5 bf16 copies (2000 B)
    [target] = _table(text, "in fp32 copies")
    cells = [target[k] for k in ("against", "in fp32 copies", "in compute-dtype copies")]
    assert cells == ["ddp-zero", "0.75", "1.50"]
    assert target["median ≤ 1.25 (fp32 / compute copies)"] == "yes / no"
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "u.png").stat().st_size > 0


def test_update_loop_refuses_acco_acc(capsys):
    """acco-acc accumulates while a round is in flight, which only the awc loop does: the sweeps and the worker
    refuse it in the update loop, before running anything."""
    import overlap
    import worker

    with pytest.raises(SystemExit, match="only the awc loop"):
        overlap.main(["--loopback", "--loop", "update", "--methods", "compute,acco-acc"])
    with pytest.raises(SystemExit):
        worker.parse_args(["--method", "acco-acc", "--loop", "update"])
    assert "only the awc loop" in capsys.readouterr().err
    assert worker.parse_args(["--method", "acco", "--loop", "update", "--dtype", "bf16"]).dtype == "bf16"


def test_dpu_ef_is_mode_dpu_with_error_feedback_in_the_update_loop_only(tmp_path, capsys):
    """dpu-ef times mode dpu with delay_correction=1.0 (the records say so, as the optimizer holds it); the library
    refuses delay_correction with accumulate_while_communicating, so the sweeps and the worker refuse dpu-ef in
    the awc loop before running anything."""
    import overlap
    import worker

    with pytest.raises(SystemExit, match="only the update loop"):
        overlap.main(["--loopback", "--loop", "awc", "--methods", "dpu,dpu-ef"])
    with pytest.raises(SystemExit):
        worker.parse_args(["--method", "dpu-ef", "--loop", "awc"])
    assert "only the update loop" in capsys.readouterr().err
    out = tmp_path / "ef.jsonl"
    run_command([sys.executable, str(BENCH / "overlap.py"), "--loopback", "--smoke", "--repeats", "1", "--loop",
                 "update", "--methods", "dpu,dpu-ef", "--out", str(out)], timeout=300)
    dpu, ef = _records(out)
    assert dpu["options"]["mode"] == ef["options"]["mode"] == "dpu"
    assert (dpu["options"]["delay_correction"], ef["options"]["delay_correction"]) == ("0.0", "1.0")
    assert ef["tokens_per_s"] > 0 and ef["summary"]["rounds"] > 0


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
                    "### 5. Memory", "### 6. Host synchronisations", "### 7. A device-found error",
                    "### 8. How a process ends", "### 9. Per-update time at", "### 10. DTensor parameters",
                    "### 11. Compressed rounds", "### Verdict"):
        assert section in text, section
    assert "raised in updates [4, 4]" in text and "\nPASS\n" in text  # the inf loss is in update 3's last micro-batch
    assert "exit 0" in text and "skipped" in text
    assert "no recompiles" in text
    assert "| int8 |" in text and "| fp8 |" in text and "| int4 |" in text  # the quantizer's timings, each kind
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


def test_trace_analysis_takes_the_streams_from_markers_and_syncs_from_the_window():
    """The first GPU run's trace: the rounds' stream had more kernel time than compute's, so 'the busiest
    stream is compute' measured the wrong overlap, and the profiler's own cudaDeviceSynchronize calls
    (outside the updates) counted as host syncs. Markers name the streams; the window bounds the syncs."""
    import gpu_check

    events = [
        {"ph": "X", "cat": "kernel", "name": "void at::cuda::spin_kernel(long)", "ts": 0, "dur": 1, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "void at::cuda::spin_kernel(long)", "ts": 2, "dur": 1, "args": {"stream": 14}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 1, "dur": 1},  # outside
        {"ph": "X", "cat": "user_annotation", "name": gpu_check.WINDOW, "ts": 10, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10, "dur": 10, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "adam", "ts": 15, "dur": 40, "args": {"stream": 14}},  # 5 of 40 under
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_ReduceScatter", "ts": 60, "dur": 20, "args": {"stream": 14}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 70, "dur": 20, "args": {"stream": 7}},  # half the nccl
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 50, "dur": 1},  # inside
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 120, "dur": 1},  # outside
    ]
    r = gpu_check.analyze_trace(events, updates=1, window=gpu_check.WINDOW)
    assert r["compute_stream"] == 7 and r["overlap"] == {14: 15 / 60} and r["comm_overlap"] == 0.5
    assert r["host_syncs_per_update"] == {"cudaEventSynchronize": 1.0}
    unmarked = gpu_check.analyze_trace([e for e in events if "spin" not in e.get("name", "")], updates=1)
    assert unmarked["compute_stream"] == 14 and len(unmarked["host_syncs_per_update"]) == 2  # the old reading
    assert unmarked["streams_from"] == "busiest stream" and r["streams_from"] == "markers"
    assert not gpu_check.analyze_trace(events, updates=1, window="renamed")["window_found"]
    nccl_elsewhere = events + [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 10, "dur": 10,
                                "args": {"stream": 30}}]  # the process group's own stream, fully under compute
    assert gpu_check.analyze_trace(nccl_elsewhere, updates=1, window=gpu_check.WINDOW)["comm_overlap"] == 20 / 30


def test_gpu_check_verdict_fails_on_what_a_gpu_must_not_show():
    """The verdict names each failure of a GPU run: a sync in the steady state, blocking calls in the trace
    beyond the library's counted waits, a side stream not overlapped, errors at different steps."""
    import gpu_check

    good = {"tests": {"exit": 0, "summary": "19 passed"}, "errors": {"same_step": True, "raised_at": [4, 4]},
            "exits": {"return": {"code": 0, "want": 0, "aborted": False, "tail": []}},
            "syncs": {"sync_warnings_per_update": 0.0, "examples": [], "host_waits_per_update": 0.5},
            "trace": {"host_syncs_per_update": {"cudaEventSynchronize": 0.5}, "compute_stream": 7, "overlap": {13: 0.9},
                      "streams_from": "markers"}}
    assert gpu_check.verdict(good, dry=False) == []
    bad = {"tests": {"exit": 1, "summary": "1 failed"}, "errors": {"same_step": False, "raised_at": [4, 5]},
           "exits": {"return": {"code": -6, "want": 0, "aborted": True, "tail": ["terminate called"]}},
           "syncs": {"sync_warnings_per_update": 2.0, "examples": ["x"], "host_waits_per_update": 0.0},
           "trace": {"host_syncs_per_update": {"cudaStreamSynchronize": 1.0}, "compute_stream": 7, "overlap": {13: 0.1},
                     "comm_overlap": 0.1, "streams_from": "markers"}}
    failures = gpu_check.verdict(bad, dry=False)
    assert len(failures) == 6, failures
    dtensor = {"torch": "2.11", "tp": {"max_abs_diff": 3e-4}, "fsdp2": {"refused": "NotImplementedError: x"}}
    assert len(gpu_check.verdict(dict(good, dtensor=dtensor), dry=True)) == 1  # FSDP2 refused by design below 2.13
    dtensor = {"torch": "2.13", "tp": {"refused": "NotImplementedError: x"}, "fsdp2": {"max_abs_diff": 0.0}}
    assert len(gpu_check.verdict(dict(good, dtensor=dtensor), dry=True)) == 1  # TP is never refused
    assert len(gpu_check.verdict(bad, dry=True)) == 3  # a dry run: the CUDA tests' exit, the exits, the error step
    for trace, text in (({"streams_from": "busiest stream"}, "marker kernels were not found"),
                        ({"window_found": False}, "host-blocking calls were not counted"),
                        ({"world": 2, "comm_overlap": None}, "no collective kernels traced")):
        assert [f for f in gpu_check.verdict(dict(good, trace={**good["trace"], **trace}), dry=False)
                if text in f], trace  # a trace that cannot be read fails, rather than passing vacuously
    raised = dict(good, memory={"error": "RuntimeError: x", "traceback": []})
    assert gpu_check.verdict(raised, dry=True) == ["section memory raised RuntimeError: x"]
    err = raised["memory"]
    block = gpu_check.render({"device_name": "d", "tests": {"command": "c", "exit": 0, "summary": "s"},
                              **{k: err for k in ("trace", "overhead", "compile", "memory", "syncs", "errors", "exits",
                                                  "gpt", "dtensor")},
                              "failures": ["f"]}, dry=True, device="cpu", argv=[])
    assert block.count("**Raised** `RuntimeError: x`") == 9 and "FAIL: f" in block


@pytest.mark.parametrize("script", ["gpu_time.py", "gpu_memory.py"])
def test_gpu_optimizer_benchmarks_run_dry_on_cpu(script):
    """The per-optimizer GPU benchmarks (time, memory) run end to end on CPU: every configuration prints a row."""
    extra = ["--repeats", "1"] if script == "gpu_time.py" else []
    r = subprocess.run([sys.executable, str(BENCH / script), "--dry-run", *extra], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from gpu_time import CONFIGS

    rows = [l.split()[0] for l in r.stdout.splitlines() if l.strip() and l.split()[0] in CONFIGS
            and ("|" in l or "steady" in l)]
    assert rows == CONFIGS, r.stdout


def test_composed_time_to_target_is_updates_times_time_per_update():
    """benchmarks/compose_time_to_target.py on the recorded data: each row's time to DDP's loss is its updates
    ratio times its time per update, DDP's row is 1, and the time per update is DDP's tokens/s over the
    method's, per repeat, as benchmarks/report.py pairs them."""
    import compose_time_to_target as compose
    import report

    speed = ROOT / "docs" / "benchmarks_data" / "compression.jsonl"
    out = compose.table(speed, ROOT / "docs" / "convergence_data" / "time_to_target.jsonl")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()[2:]]
    assert {r[2] for r in rows} >= {"DDP + AdamW", "ACCO default", "ACCO + int8"}, out
    pts = next(iter(report.points(report.load(speed), "compression").values()))
    labels = {v: k for k, v in compose.NAMES.items()}
    assert {r[2] for r in rows} >= {"DDP + PowerSGD (rank 4)"}, out
    for rate, x, name, updates, per, composed in rows:
        bound = updates.startswith("≥ ")  # a method beyond the longest run searched: its ratio is a lower bound
        assert bound == composed.startswith("≥ ") == (name == "DDP + PowerSGD (rank 4)"), (name, updates, composed)
        u, t, c = (float(cell.removeprefix("≥ ").split()[0]) for cell in (updates, per, composed))
        assert c == pytest.approx(u * t, abs=0.011), (name, u, t, c)  # (t shown to 2 decimals)
        label = compose.METHODS[labels[name]]
        expect = statistics.median([1 / r for r in pts[float(rate)].ratio(label, "ddp") if r])
        assert t == pytest.approx(expect, abs=0.006), (name, rate, t, expect)
        if name == "DDP + AdamW":
            assert (u, t, c) == (1.0, 1.0, 1.0)


def test_composed_time_to_target_takes_longer_branches_as_longer_bounds(tmp_path):
    """A seed the study left beyond its longest run (PowerSGD past 1.5x) gets a longer branch's length as its
    bound when that branch still ended above DDP's loss for that seed, and keeps the study's bound when it ended
    below (its ratio is then somewhere between) or when the branch is another method's or seed's."""
    import compose_time_to_target as compose

    records = ROOT / "docs" / "convergence_data" / "time_to_target.jsonl"
    study = compose.updates_ratios(records)["ddp-powersgd"]
    assert study == [(1.5, True)] * 3, study  # the study's bound on every seed
    branch = {"kind": "branch", "method": "ddp-powersgd", "lr": 0.004, "warmup": 100, "floor": 0.0}
    rows = [dict(branch, seed=0, T=1250, final_val_loss=1.40),  # above DDP's 1.2891 at 500: beyond 2.5x
            dict(branch, seed=0, T=1000, final_val_loss=1.45),  # a shorter one: the longer bound stands
            dict(branch, seed=1, T=1250, final_val_loss=1.20),  # below DDP's 1.2934: the 1.5 bound stays
            dict(branch, seed=2, T=1250, final_val_loss=1.40, lr=0.002)]  # another LR: not this line's
    longer = tmp_path / "longer.jsonl"
    longer.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert compose.updates_ratios(records, longer)["ddp-powersgd"] == [(2.5, True), (1.5, True), (1.5, True)]
    assert compose.updates_ratios(records, tmp_path / "absent.jsonl")["ddp-powersgd"] == study
