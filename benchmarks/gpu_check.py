"""The GPU acceptance, in one command, for the first machine with an NVIDIA GPU:

    .venv/bin/python benchmarks/gpu_check.py               # on the GPU machine: rewrites docs/studies/gpu-runs.md's block
    .venv/bin/python benchmarks/gpu_check.py --dry-run --out /tmp/gpu.md   # on CPU (CI runs this)

Ten checks, each a section of the report, on a process group of one NCCL
rank; the script exits 1, naming what failed, if a GPU run finds a failing
CUDA test, a section that raised, a host synchronisation in the steady state,
collective kernels not under compute, or ranks that raise a device-found
error at different steps:

1. ``tests/test_cuda.py`` (pytest; all skip without a GPU).
2. A ``torch.profiler`` trace of a few updates on one GPU: kernel time per
   CUDA stream (marker kernels name the compute and the side stream), how
   much of the side stream's kernel time (the rounds) runs while a compute
   kernel runs (the next backward), the same for its collective kernels
   alone (none on one rank), and the host-blocking CUDA runtime calls per
   update inside the updates (``cudaDeviceSynchronize``,
   ``cudaStreamSynchronize``, ``cudaEventSynchronize``; the loop should
   issue none). The optimizer's kernels on the side stream compete with
   compute for the SMs, so their share is reported and not judged.
3. The per-update time of ACCO against plain ``torch.optim.AdamW`` on one GPU
   (same model and micro-batches; interleaved repeats, median and spread).
4. ``torch.compile(model)`` trained through ACCO's swaps: compiled frames after
   the first update and after the last must be equal (no recompiles).
5. Peak GPU memory (above what was allocated before) against the buffers of ``docs/algorithm.md``'s table.
6. Host-blocking calls per update after the first applied step, under
   ``torch.cuda.set_sync_debug_mode("warn")`` (blocking copies and stream
   synchronisations), and the library's own waits for a round two hand-offs
   old (``scheduler.host_waits``: only a host running ahead of the device).
7. Two ranks (NCCL; needs two GPUs) with an inf loss on one rank under
   ``nonfinite="raise"``: both must raise in the same update.
8. A script that ends without ``finish()`` (return, ``sys.exit``, Ctrl-C)
   with a round in flight exits as the same script with torch's AdamW does,
   without a C++ abort.
9. The per-update time of ACCO against plain AdamW on examples/gpt's decoder
   (12 layers of 768) at 65,536 tokens per update, bf16 autocast, with the
   foreach and the fused AdamW kernels, and the host's time in ``step()``.
10. DTensor parameters (tensor parallelism, FSDP2) on a (1, 1) mesh against
    plain ones: equal weights after 6 updates (FSDP2 of torch < 2.13 refused),
    also clipped (the DTensor norm's counted ranges) and with FSDP2's
    ``set_is_last_backward(False)`` before each update's last micro-batch
    (its post-reduce stream, which the compute stream must wait for). One
    device cannot reach the norm over a model group (two or more model
    ranks), tensor-parallel collectives between devices, nor ACCO across
    hosts; the simulated device covers those (``tests/fake_cuda.py``).

``--dry-run`` runs every section on the CPU with a tiny model so the script
itself is exercised: the CUDA tests skip, the profiler sees no kernels (the
trace analysis is shown on a synthetic trace instead, labelled so), timings
are CPU timings of a toy, and compile uses the ``eager`` backend. A dry run
never writes a file unless ``--out`` says so.

The report is a block between ``<!-- gpu_check:begin -->`` and ``<!-- gpu_check:end -->``: the script
replaces that block in the report file (``docs/studies/gpu-runs.md`` by default, the GPU runs' records;
``docs/gpu.md`` sums them up), or appends it to a file without one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import nn
from torch.torch_version import TorchVersion

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from acco import AccoOptimizer  # noqa: E402

BEGIN, END = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"
WINDOW = "gpu_check.updates"  # the profiled updates' record_function range
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories of work on a CUDA stream
HOST_SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


# ---------------------------------------------------------------- the model and the loop


def make_model(width: int, layers: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    blocks: List[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks).to(device)


def batches(width: int, batch: int, device: str, n: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g).to(device), torch.randn(batch, width, generator=g).to(device))
            for _ in range(n)]


def train(model: nn.Module, opt: torch.optim.Optimizer, data, updates: int, m: int) -> None:
    for t in range(updates):
        for j in range(m):
            x, y = data[(t * m + j) % len(data)]
            (((model(x) - y) ** 2).mean() / m).backward()
        opt.step()
        opt.zero_grad()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------- 1. the CUDA tests


def check_tests() -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-s", "tests/test_cuda.py"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = [l for l in r.stdout.splitlines() if l.strip()]
    # The tests' output (what they print: the user paths' losses; failures) goes to the log, the summary to the report
    print(r.stdout[-12000:], r.stderr[-2000:] if r.returncode not in (0, 5) else "", sep="\n", file=sys.stderr)
    return {"command": " ".join(cmd[1:]), "exit": r.returncode, "summary": lines[-1] if lines else r.stderr[-300:]}


# ---------------------------------------------------------------- 2. the profiler trace


def analyze_trace(events: Sequence[Dict[str, Any]], updates: int, window: str = None) -> Dict[str, Any]:
    """From Chrome-trace events: kernel time per stream, the side streams' kernel time overlapped by the compute
    stream's kernels, and host-blocking runtime calls per update. Pure: testable on a synthetic trace.

    ``window``: the name of a ``record_function`` range around the updates; host-blocking calls outside it (the
    profiler's own, the script's synchronisations) are not counted. Two ``spin_kernel`` markers
    (``torch.cuda._sleep``), the first on the compute stream and the second on the round's side stream, name the
    streams; without them the stream with the most kernel time is taken for the compute stream."""
    kernels: Dict[Any, List[Tuple[float, float]]] = {}
    names: Dict[Any, List[str]] = {}
    markers: List[Tuple[float, Any]] = []
    syncs: List[Tuple[float, str]] = []
    spans: List[Tuple[float, float]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        ts, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if e.get("cat") in DEVICE_WORK:
            stream = e.get("args", {}).get("stream")
            if "spin_kernel" in e.get("name", ""):
                markers.append((ts, stream))
            else:
                kernels.setdefault(stream, []).append((ts, end))
                names.setdefault(stream, []).append(e.get("name", ""))
        elif e.get("cat") == "cuda_runtime" and e.get("name") in HOST_SYNCS:
            syncs.append((ts, e["name"]))
        elif window is not None and e.get("cat") == "user_annotation" and e.get("name") == window:
            spans.append((ts, end))
    counted: Dict[str, int] = {}
    for ts, name in syncs:
        if window is None or any(a <= ts <= b for a, b in spans):
            counted[name] = counted.get(name, 0) + 1
    busy = {s: sum(b - a for a, b in iv) for s, iv in kernels.items()}
    out: Dict[str, Any] = {"kernel_us_per_stream": busy, "host_syncs_per_update": {k: v / updates for k, v in counted.items()},
                           "window_found": window is None or bool(spans)}
    if not kernels:
        out["compute_stream"] = out["overlap"] = out["comm_overlap"] = out["streams_from"] = None
        return out
    markers.sort()
    if len(markers) >= 2:
        compute, sides, out["streams_from"] = markers[0][1], [markers[1][1]], "markers"
    else:  # the stream with the most kernel time: forward and backward
        compute, out["streams_from"] = max(busy, key=busy.get), "busiest stream"
        sides = [s for s in kernels if s != compute]
    out["compute_stream"] = compute
    merged = _merge(kernels.get(compute, []))
    overlap = {}
    for s in sides:
        iv = kernels.get(s, [])
        covered = sum(_intersection(a, b, merged) for a, b in iv)
        overlap[s] = covered / busy[s] if busy.get(s) else None
    out["overlap"] = overlap  # per side stream: share of its kernel time with a compute kernel running
    # Collectives run on the process group's own streams (NCCL's), not necessarily the rounds' side stream.
    comm = [iv for s in kernels if s != compute for iv, name in zip(kernels[s], names[s]) if "nccl" in name.lower()]
    comm_us = sum(b - a for a, b in comm)
    # The communication's share under compute: what ACCO hides. None where no collective ran a kernel.
    out["comm_overlap"] = sum(_intersection(a, b, merged) for a, b in comm) / comm_us if comm_us > 0 else None
    return out


def _merge(iv: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _intersection(a: float, b: float, merged: List[Tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for c, d in merged)


SYNTHETIC_TRACE = [  # what a good trace looks like: side-stream kernels under compute kernels, no host syncs
    {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100, "args": {"stream": 7}},
    {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100, "dur": 100, "args": {"stream": 7}},
    {"ph": "X", "cat": "kernel", "name": "ncclKernel_ReduceScatter", "ts": 20, "dur": 60, "args": {"stream": 13}},
    {"ph": "X", "cat": "kernel", "name": "multi_tensor_apply_kernel", "ts": 150, "dur": 80, "args": {"stream": 13}},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 1},
]


def check_trace(width: int, layers: int, batch: int, device: str, dry: bool) -> Dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    model = make_model(width, layers, device)
    opt = AccoOptimizer(model.parameters(), mode="acco", microbatches_per_update=4, lr=1e-4)
    data = batches(width, batch, device, 8)
    train(model, opt, data, 2, 4)  # warm up: state allocated, learned nothing (M given)
    synchronize(device)
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    updates = 4
    with profile(activities=activities) as prof:
        if cuda:  # markers that name the streams in the trace: compute first, then the rounds' side stream
            torch.cuda._sleep(1000)
            synchronize(device)
            with torch.cuda.stream(opt.scheduler.side_stream):
                torch.cuda._sleep(1000)
            synchronize(device)
        with torch.profiler.record_function(WINDOW):
            train(model, opt, data, updates, 4)
        synchronize(device)
    opt.finish()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    result = analyze_trace(events, updates, WINDOW)
    result["world"] = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if dry and result["compute_stream"] is None:
        result["synthetic_trace_analysis"] = analyze_trace(SYNTHETIC_TRACE, 1)
    return result


# ---------------------------------------------------------------- 3. overhead vs plain AdamW


def check_overhead(width: int, layers: int, batch: int, device: str, repeats: int, updates: int) -> Dict[str, Any]:
    data = batches(width, batch, device, 8)
    times: Dict[str, List[float]] = {"adamw": [], "acco": []}
    for _ in range(repeats):
        for method in ("adamw", "acco"):  # interleaved: A B A B ...
            model = make_model(width, layers, device)
            opt: Any = (torch.optim.AdamW(model.parameters(), lr=1e-4) if method == "adamw" else
                        AccoOptimizer(model.parameters(), mode="acco", microbatches_per_update=4, lr=1e-4))
            train(model, opt, data, 2, 4)  # warm-up
            synchronize(device)
            t0 = time.perf_counter()
            train(model, opt, data, updates, 4)
            synchronize(device)
            times[method].append((time.perf_counter() - t0) / updates)
            if method == "acco":
                opt.finish()
    ratios = [a / b for a, b in zip(times["acco"], times["adamw"])]
    return {
        "s_per_update_median": {k: statistics.median(v) for k, v in times.items()},
        "acco_over_adamw_median": statistics.median(ratios),
        "acco_over_adamw_range": (min(ratios), max(ratios)),
        "repeats": repeats,
    }


# ---------------------------------------------------------------- 4. torch.compile


def check_compile(width: int, layers: int, batch: int, device: str, dry: bool) -> Dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = make_model(width, layers, device)
    compiled = torch.compile(model, backend="eager" if dry else "inductor")
    opt = AccoOptimizer(model.parameters(), mode="acco", microbatches_per_update=2, lr=1e-4)
    data = batches(width, batch, device, 8)
    def frames() -> int:
        return sum(counters["frames"].values())

    train(compiled, opt, data, 1, 2)
    after_first = frames()
    train(compiled, opt, data, 5, 2)
    after_last = frames()
    with opt.committed_weights():
        compiled(data[0][0])
    opt.finish()
    after_finish = frames()
    return {"backend": "eager" if dry else "inductor", "frames_after_first_update": after_first,
            "frames_after_six_updates": after_last, "frames_after_committed_eval": after_finish,
            "no_recompiles": after_first == after_last == after_finish}


# ---------------------------------------------------------------- 5. memory


def check_memory(width: int, layers: int, batch: int, device: str) -> Dict[str, Any]:
    cuda = device.startswith("cuda")
    gc.collect()  # earlier sections' optimizers and models, if a cycle still holds one
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    # What earlier sections left allocated is not this run's: the first GPU run counted it (the optimizers of
    # sections 2-4, which a reference cycle kept, now gone) and reported 2.11x the table where
    # benchmarks/gpu_memory.py measured 1.10x.
    base = torch.cuda.memory_allocated() if cuda else 0
    model = make_model(width, layers, device)
    opt = AccoOptimizer(model.parameters(), mode="acco", microbatches_per_update=4, lr=1e-4)
    data = batches(width, batch, device, 8)
    train(model, opt, data, 3, 4)
    synchronize(device)
    report = opt.memory_report()
    opt.finish()
    table = report["params"] + report["library_total"]  # docs/algorithm.md's buffers, as memory_report counts them
    out: Dict[str, Any] = {"table_bytes": table, "memory_report": report}
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
        out.update(peak_allocated_bytes=peak, peak_over_table=peak / table)
    return out


# ---------------------------------------------------------------- 6. host syncs in the steady state


def check_syncs(width: int, layers: int, batch: int, device: str) -> Dict[str, Any]:
    """Host-blocking CUDA calls per update once the first step has been applied (2 warm-up updates)."""
    cuda = device.startswith("cuda")
    model = make_model(width, layers, device)
    opt = AccoOptimizer(model.parameters(), mode="acco", microbatches_per_update=4, max_grad_norm=1.0, lr=1e-4)
    data = batches(width, batch, device, 8)
    train(model, opt, data, 2, 4)
    synchronize(device)
    updates, waits = 8, opt.scheduler.host_waits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            train(model, opt, data, updates, 4)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    # torch's warning for each synchronising call (not its one-off "prototype feature" notice on entering the mode)
    found = [str(w.message).splitlines()[0] for w in caught if "called a synchronizing" in str(w.message)]
    waits = opt.scheduler.host_waits - waits
    opt.finish()
    return {"measured": cuda, "updates": updates, "sync_warnings_per_update": len(found) / updates,
            "examples": found[:3], "host_waits_per_update": waits / updates}


# ---------------------------------------------------------------- 7. device-found errors on every rank alike


def _error_rank(rank: int, world: int, port: int, device: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    from acco import NonFiniteGradientError

    dev = f"cuda:{rank}" if cuda else "cpu"
    model = make_model(64, 2, dev)
    opt = AccoOptimizer(model.parameters(), mode="acco", microbatches_per_update=4, nonfinite="raise", lr=1e-4)
    data = batches(64, 8, dev, 8)
    raised_at = None
    try:
        for t in range(10):
            for j in range(4):
                x, y = data[(t * 4 + j) % len(data)]
                loss = ((model(x) - y) ** 2).mean() / 4
                if (t, j, rank) == (3, 3, 0):
                    loss = loss * float("inf")
                loss.backward()
            opt.step()
            opt.zero_grad()
        opt.finish()
    except NonFiniteGradientError:
        raised_at = t
    Path(out, f"rank{rank}.json").write_text(json.dumps({"raised_at": raised_at}))
    torch.distributed.destroy_process_group()


def check_error_step(device: str) -> Dict[str, Any]:
    """Both ranks raise NonFiniteGradientError in the same update (the CUDA path reads round k-2's report at
    hand-off k). On CPU (dry run) two gloo ranks run the CPU path, which shows the script works."""
    if device.startswith("cuda") and torch.cuda.device_count() < 2:
        return {"ranks": 0, "raised_at": None, "same_step": None, "note": "needs two GPUs: not run"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_error_rank, args=(2, port, device, tmp), nprocs=2, join=True)
        raised = [json.loads(Path(tmp, f"rank{r}.json").read_text())["raised_at"] for r in range(2)]
    return {"ranks": 2, "raised_at": raised, "same_step": raised[0] is not None and raised[0] == raised[1]}


EXIT_CASES = ("return", "exit", "interrupt")  # how main() ends


def _exit_script(device: str, how: str, reference: bool) -> None:
    """Child process of :func:`check_exits`: mode acco (``reference``: torch's AdamW instead) in a ``main()`` that
    ends ``how`` with a round in flight, never calling ``finish()`` or ``destroy_process_group()`` (one rank:
    NCCL on a GPU, gloo on a dry run)."""
    def main() -> None:
        cuda = device.startswith("cuda")
        torch.distributed.init_process_group("nccl" if cuda else "gloo", init_method=os.environ["ACCO_EXIT_INIT"],
                                             rank=0, world_size=1)
        model = make_model(64, 2, device)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-4) if reference else
               AccoOptimizer(model.parameters(), mode="acco", microbatches_per_update=2, lr=1e-4))
        train(model, opt, batches(64, 8, device, 4), updates=6, m=2)
        if how == "exit":
            sys.exit(3)
        if how == "interrupt":
            os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt with a round in flight
            time.sleep(30)

    main()


def check_exits(device: str) -> Dict[str, Any]:
    """A script that returns from main() without finish(), calls sys.exit(3) or gets Ctrl-C, each with a round
    in flight (on a GPU: the NCCL round group and the side stream's last round): it must exit with the code of
    the same script with torch's AdamW, in the same environment, without "terminate called" (a C++ abort) or
    a hang. The reference, not a fixed code: the GPU machines' torch 2.11 exits 1, not by SIGINT, on Ctrl-C
    once torch._dynamo is imported (torch.optim's first step imports it), with or without acco."""
    def launch(how: str, reference: bool) -> Tuple[Any, str]:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "ACCO_EXIT_INIT": f"file://{tmp}/store", "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, str(Path(__file__).resolve()), "--exit-script", how, "--device", device]
            try:
                r = subprocess.run(cmd + (["--reference"] if reference else []), capture_output=True, text=True,
                                   timeout=180, env=env)
                return r.returncode, r.stdout + r.stderr
            except subprocess.TimeoutExpired as e:
                return None, f"hung: {e}"

    out: Dict[str, Any] = {}
    for how in EXIT_CASES:
        want, ref_text = launch(how, reference=True)
        code, text = launch(how, reference=False)
        out[how] = {"code": code, "want": want, "aborted": "terminate called" in text,
                    "tail": text.strip().splitlines()[-3:] if code != want else [],
                    "reference_aborted": "terminate called" in ref_text}
    return out


# ---------------------------------------------------------------- 9. a GPT at a realistic batch


def gpt_setup(dry: bool) -> Tuple[Any, int, int]:
    """examples/gpt's decoder and its micro-batch: 12 layers of 768 at 1024 tokens, 16 sequences per micro-batch
    and 4 micro-batches per update (65,536 tokens per update); a toy on a dry run."""
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPTConfig  # noqa: E402  examples/gpt/model.py

    if dry:
        return GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, local_window=8), 2, 2
    return GPTConfig(vocab_size=8192, seq_len=1024, d_model=768, n_layers=12, n_heads=12, local_window=256), 16, 4


def check_gpt_overhead(device: str, dry: bool, repeats: int) -> Dict[str, Any]:
    """Per-update time of ACCO (mode acco, the defaults) against ``torch.optim.AdamW`` on examples/gpt's decoder
    under bf16 autocast, at 65,536 tokens per update, with the foreach and the fused AdamW kernels: interleaved
    repeats, median and spread of each ratio, and the host's time in ``step()`` + ``zero_grad()`` per update.

    Each run warms up 4 updates and times 10: a shorter window (2 and 6) measured a transient, the more so after
    the other sections in the same process (docs/studies/gpu-runs.md, the sixth run)."""
    cfg, mb, m = gpt_setup(dry)
    from model import GPT  # noqa: E402  (gpt_setup put examples/gpt on the path)

    g = torch.Generator().manual_seed(2)
    data = [torch.randint(cfg.vocab_size, (mb, cfg.seq_len + 1), generator=g).to(device) for _ in range(4)]
    cuda = device.startswith("cuda")
    updates, warm = (2, 1) if dry else (10, 4)

    def run(model: nn.Module, opt: Any, n: int, host: List[float]) -> None:
        for t in range(n):
            for j in range(m):
                seq = data[(t * m + j) % len(data)]
                with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=cuda):
                    logits = model(seq[:, :-1])
                loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten())
                (loss / m).backward()
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            host.append(time.perf_counter() - t0)

    methods = ("adamw", "acco", "adamw-fused", "acco-fused")
    times: Dict[str, List[float]] = {k: [] for k in methods}
    host: Dict[str, List[float]] = {k: [] for k in methods}
    for _ in range(repeats):
        for method in methods:  # interleaved: A B C D A B C D ...
            torch.manual_seed(0)
            model = GPT(cfg).to(device)
            # Each side with the kernel named: ACCO's default on CUDA is the fused one (acco-fused), torch's foreach
            kw = {"fused": True} if method.endswith("-fused") else {"foreach": True}
            opt: Any = (torch.optim.AdamW(model.parameters(), lr=3e-4, **kw) if method.startswith("adamw") else
                        AccoOptimizer(model.parameters(), mode="acco", microbatches_per_update=m, lr=3e-4, **kw))
            run(model, opt, warm, [])
            synchronize(device)
            t0 = time.perf_counter()
            run(model, opt, updates, host[method])
            synchronize(device)
            times[method].append((time.perf_counter() - t0) / updates)
            if method.startswith("acco"):
                opt.finish()
            del model, opt
            gc.collect()
    out: Dict[str, Any] = {
        "config": f"{cfg.n_layers} layers of {cfg.d_model}, vocab {cfg.vocab_size}",
        "params": sum(p.numel() for p in GPT(cfg).parameters()), "tokens_per_update": mb * cfg.seq_len * m,
        "microbatches": m, "warmup_updates": warm, "timed_updates": updates, "repeats": repeats,
        "s_per_update_median": {k: statistics.median(v) for k, v in times.items()},
        "host_step_s_median": {k: statistics.median(v) for k, v in host.items()}}

    def ratio(acco: str, adamw: str) -> Tuple[float, float, float]:  # per repeat: median, min, max
        r = [a / b for a, b in zip(times[acco], times[adamw])]
        return statistics.median(r), min(r), max(r)

    out["acco_over_adamw_median"], *low_high = ratio("acco", "adamw")  # the same kernel on both sides
    out["acco_over_adamw_range"] = tuple(low_high)
    out["fused_acco_over_adamw"] = ratio("acco-fused", "adamw-fused")
    # The defaults against each other: ACCO's on CUDA (fused) against torch's AdamW (foreach)
    out["default_acco_over_default_adamw"] = ratio("acco-fused" if cuda else "acco", "adamw")
    return out


# ---------------------------------------------------------------- 10. DTensor parameters on the device


def check_dtensor(device: str) -> Dict[str, Any]:
    """docs/models-larger-than-one-device.md's path on this device: tensor parallelism and FSDP2 on a (1, 1)
    ('dp', 'tp') mesh, AccoOptimizer (mode acco) over mesh['dp'], against the same model with plain parameters
    and the same optimizer: the weights after 6 updates must agree within 1e-5 (on one rank the shards are the
    whole tensors, so only the DTensor path itself can differ). FSDP2 of a torch older than 2.13 is refused
    at step() by design (mesh.refuse_grad_outside_autograd); that refusal is reported, not failed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if not torch.distributed.is_initialized():  # a dry run: a gloo group of one
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mesh = init_device_mesh(device.split(":")[0], (1, 1), mesh_dim_names=("dp", "tp"))
    width, m = 256, 4
    data = batches(width, 8, device, 8)

    def trained(kind: str, clip: Any = None, accumulating: bool = False) -> List[torch.Tensor]:
        model = make_model(width, 2, device)  # Linear, GELU, Linear, GELU
        kw: Dict[str, Any] = {"max_grad_norm": clip}
        if kind == "tp":
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            kw["process_group"] = mesh["dp"]
        elif kind == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=mesh["tp"])
            kw["process_group"] = mesh["dp"]
        opt = AccoOptimizer(model.parameters(), mode="acco", microbatches_per_update=m, lr=1e-3, **kw)
        if accumulating:  # FSDP2 skips its end-of-backward wait on its post-reduce stream but after the last
            for t in range(6):
                for j in range(m):
                    model.set_is_last_backward(j == m - 1)
                    x, y = data[(t * m + j) % len(data)]
                    (((model(x) - y) ** 2).mean() / m).backward()
                opt.step()
                opt.zero_grad()
        else:
            train(model, opt, data, 6, m)
        opt.finish()
        return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
                for p in model.parameters()]

    clip = 0.05  # small enough to clip every update
    plain = {None: trained("plain"), clip: trained("plain", clip)}
    out: Dict[str, Any] = {"torch": torch.__version__}
    runs = {"tp": ("tp", None, False), "fsdp2": ("fsdp2", None, False), "tp_clipped": ("tp", clip, False),
            "fsdp2_clipped": ("fsdp2", clip, False), "fsdp2_accumulating": ("fsdp2", None, True)}
    for name, (kind, c, accumulating) in runs.items():
        try:
            got = trained(kind, c, accumulating)
        except NotImplementedError as e:
            out[name] = {"refused": f"{type(e).__name__}: {e}"[:240]}
            continue
        out[name] = {"max_abs_diff": max((a - b).abs().max().item() for a, b in zip(got, plain[c]))}
    return out


def section(check, *args) -> Dict[str, Any]:
    """``check(*args)``, or ``{"error": ...}`` if it raised: one broken section must not hide the others' results
    (the first run on a new machine is the one that finds what breaks)."""
    try:
        return check(*args)
    except Exception as e:  # noqa: BLE001  reported in the section and failed in the verdict
        import traceback

        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        frames = traceback.format_exc().strip().splitlines()
        return {"error": f"{type(e).__name__}: {e}", "traceback": frames[-12:]}


def verdict(results: Dict[str, Any], dry: bool) -> List[str]:
    """What a GPU run must not show (a dry run is judged on the sections that raised and the error-step check
    only: the rest is not measured on CPU)."""
    failures = [f"section {name} raised {r['error']}" for name, r in results.items()
                if isinstance(r, dict) and "error" in r]
    t = results.get("tests", {"error": "not run"})
    if "error" not in t and t["exit"] not in (0,) and not (dry and t["exit"] == 5):
        failures.append(f"tests/test_cuda.py exited {t['exit']}: {t['summary']}")
    x = results.get("exits", {"error": "not run"})
    for how, r in x.items() if "error" not in x else ():
        if r["code"] != r["want"] or r["aborted"] or r["want"] is None:
            failures.append(f"a script ending by {how} exited {r['code']} (torch's AdamW: {r['want']}), "
                            f"{'with' if r['aborted'] else 'without'} a C++ abort: {r['tail']}")
    d = results.get("dtensor", {})
    for kind, r in d.items() if "error" not in d else ():  # "torch": the version the section ran on
        if isinstance(r, dict) and r.get("max_abs_diff", 0) > 1e-5:
            failures.append(f"DTensor parameters ({kind}) differ from plain ones by {r['max_abs_diff']:.3g} > 1e-5")
        if isinstance(r, dict) and "refused" in r and (kind.startswith("tp") or TorchVersion(d["torch"]) >= (2, 13)):
            failures.append(f"DTensor parameters ({kind}) refused: {r['refused']}")
    e = results.get("errors", {"error": "not run"})
    if "error" not in e and e["same_step"] is False:
        failures.append(f"a device-found error surfaced at different steps on the ranks: {e['raised_at']}")
    if dry:
        return failures
    s, tr = results.get("syncs", {"error": "not run"}), results.get("trace", {"error": "not run"})
    if "error" in s or "error" in tr:
        return failures
    if s["sync_warnings_per_update"] > 0:
        failures.append(f"host synchronisations in the steady state: {s['sync_warnings_per_update']} per update, "
                        f"e.g. {s['examples']}")
    blocking = sum(tr["host_syncs_per_update"].values()) - s["host_waits_per_update"]
    if blocking > 0:
        failures.append(f"host-blocking CUDA calls in the profiled updates: {tr['host_syncs_per_update']}")
    if tr["compute_stream"] is None:
        failures.append("no kernels traced")
    elif tr.get("streams_from") != "markers":
        failures.append("the trace's marker kernels were not found: the compute and side streams are unknown")
    if not tr.get("window_found", True):
        failures.append(f"the trace has no {WINDOW!r} range: host-blocking calls were not counted")
    if tr.get("world", 1) > 1 and tr.get("comm_overlap") is None:
        failures.append("no collective kernels traced on more than one rank")
    # The communication must run under compute. The side stream's other kernels (the optimizer's) compete
    # with compute for the SMs: their share is reported, not judged.
    if tr.get("comm_overlap") is not None and tr["comm_overlap"] < 0.5:
        failures.append(f"collective kernels not overlapped by compute (share {tr['comm_overlap']:.2f} < 0.5)")
    return failures


# ---------------------------------------------------------------- report


def _tests_lines(t: Dict[str, Any], dry: bool) -> List[str]:
    return [f"`{t['command']}`: exit {t['exit']}, `{t['summary']}`"]


def _trace_lines(tr: Dict[str, Any], dry: bool) -> List[str]:
    lines = []
    if tr["compute_stream"] is None:
        lines.append("No CUDA kernels in the trace (CPU run).")
        if "synthetic_trace_analysis" in tr:
            lines.append(f"Analysis of the built-in synthetic trace (checks the analysis only): "
                         f"`{tr['synthetic_trace_analysis']}`")
    else:
        lines.append(f"Kernel time per stream (us): `{tr['kernel_us_per_stream']}`; compute stream {tr['compute_stream']}.")
        lines.append(f"Share of each side stream's kernel time overlapped by compute kernels: `{tr['overlap']}`; "
                     f"of its collective (NCCL) kernels' time: `{tr.get('comm_overlap')}`.")
    lines.append(f"Host-blocking CUDA runtime calls per update: `{tr['host_syncs_per_update'] or 'none'}`.")
    return lines


def _overhead_lines(o: Dict[str, Any], dry: bool) -> List[str]:
    return [f"Median s/update: AdamW {o['s_per_update_median']['adamw']:.4g}, ACCO {o['s_per_update_median']['acco']:.4g}; "
            f"ACCO/AdamW median {o['acco_over_adamw_median']:.3f}, range {o['acco_over_adamw_range'][0]:.3f}–"
            f"{o['acco_over_adamw_range'][1]:.3f} over {o['repeats']} interleaved repeats."]


def _compile_lines(c: Dict[str, Any], dry: bool) -> List[str]:
    return [f"Compiled frames after the first update {c['frames_after_first_update']}, after six "
            f"{c['frames_after_six_updates']}, after an evaluation in committed_weights() "
            f"{c['frames_after_committed_eval']}: {'no recompiles' if c['no_recompiles'] else 'RECOMPILED'}."]


def _memory_lines(m: Dict[str, Any], dry: bool) -> List[str]:
    mib = 1 << 20
    lines = [f"Buffers of the table (parameters + memory_report's library_total): {m['table_bytes'] / mib:.1f} MiB."]
    if "peak_allocated_bytes" in m:
        lines.append(f"Peak allocated: {m['peak_allocated_bytes'] / mib:.1f} MiB "
                     f"({m['peak_over_table']:.2f}x the table; the rest is activations and temporaries).")
    else:
        lines.append("No GPU: peak device memory not measured.")
    return lines


def _syncs_lines(s: Dict[str, Any], dry: bool) -> List[str]:
    if not s["measured"]:
        return ["CPU run: torch's sync debug mode is CUDA only; not measured."]
    return [f"Under `torch.cuda.set_sync_debug_mode(\"warn\")`, {s['updates']} updates: "
            f"{s['sync_warnings_per_update']} synchronising calls per update (examples: `{s['examples']}`); "
            f"the library's waits for round k-2 at hand-off k that found it unfinished: "
            f"{s['host_waits_per_update']} per update."]


def _errors_lines(e: Dict[str, Any], dry: bool) -> List[str]:
    if not e["ranks"]:
        return [e["note"]]
    return [f"inf loss on rank 0 in update 3, nonfinite='raise': raised in updates {e['raised_at']} "
            f"(rank 0, rank 1): {'the same step' if e['same_step'] else 'DIFFERENT STEPS'}"
            f"{' (CPU path, gloo: a dry run)' if dry else ''}."]


def _exits_lines(x: Dict[str, Any], dry: bool) -> List[str]:
    return ["A `main()` with a round in flight, no `finish()`, against the same script with torch's AdamW: " + "; ".join(
        f"{how}: exit {r['code']} (AdamW: {r['want']}){', C++ ABORT' if r['aborted'] else ''}" for how, r in x.items())
        + (" (CPU path, gloo: a dry run)." if dry else " (NCCL, one rank).")]


def _gpt_lines(o: Dict[str, Any], dry: bool) -> List[str]:
    med, host = o["s_per_update_median"], o["host_step_s_median"]
    fused, dflt = o["fused_acco_over_adamw"], o["default_acco_over_default_adamw"]
    return [f"{o['config']} ({o['params'] / 1e6:.1f}M parameters), {o['tokens_per_update']:,} tokens per update "
            f"in {o['microbatches']} micro-batches, bf16 autocast{' (off on CPU)' if dry else ''}; "
            f"{o['warmup_updates']} updates of warm-up, then {o['timed_updates']} timed, {o['repeats']} interleaved "
            f"repeats:",
            "",
            "| AdamW kernel | AdamW s/update | ACCO s/update | ACCO/AdamW median (range) | host s in step() per update, "
            "AdamW / ACCO |",
            "|---|---|---|---|---|",
            f"| foreach (`foreach=True`) | {med['adamw']:.4g} | {med['acco']:.4g} | {o['acco_over_adamw_median']:.3f} "
            f"({o['acco_over_adamw_range'][0]:.3f}–{o['acco_over_adamw_range'][1]:.3f}) | {host['adamw']:.4f} / "
            f"{host['acco']:.4f} |",
            f"| fused (`fused=True`) | {med['adamw-fused']:.4g} | {med['acco-fused']:.4g} | {fused[0]:.3f} "
            f"({fused[1]:.3f}–{fused[2]:.3f}) | {host['adamw-fused']:.4f} / {host['acco-fused']:.4f} |",
            "",
            f"Each library's default against the other's (ACCO: fused on CUDA; torch's AdamW: foreach): ACCO/AdamW "
            f"median {dflt[0]:.3f} ({dflt[1]:.3f}–{dflt[2]:.3f})."]


def _dtensor_lines(d: Dict[str, Any], dry: bool) -> List[str]:
    def one(r: Dict[str, Any]) -> str:
        return f"refused ({r['refused']})" if "refused" in r else f"max |difference| {r['max_abs_diff']:.3g}"
    names = {"tp": "tensor parallelism", "fsdp2": "FSDP2", "tp_clipped": "tensor parallelism, clipped",
             "fsdp2_clipped": "FSDP2, clipped", "fsdp2_accumulating": "FSDP2 with set_is_last_backward(False)"}
    runs = "; ".join(f"{label} {one(d[k])}" for k, label in names.items() if k in d)
    return [f"Weights after 6 updates (mode acco, a (1, 1) mesh, process_group=mesh['dp']) against plain "
            f"parameters, torch {d['torch']}: {runs}. Not reachable on one device: the norm over a model group, "
            "tensor-parallel collectives between devices, ACCO across hosts (the simulated device's tests cover "
            "them)."]


def check_quantize(device: str, dry: bool, repeats: int) -> Dict[str, Any]:
    """What compression (``compression=`` each of ``quantize.KINDS``: int8, fp8, int4) costs a round on one
    device: the time to quantize and to dequantize one round's gradients, examples/gpt's decoder at 65,536 tokens
    per update (section 9's model), blocks of 256, against the bytes the round then sends (median of ``repeats``
    timed runs after one warm-up each)."""
    from acco.quantize import KINDS, dequantize, packed_size, quantize

    cfg, _, _ = gpt_setup(dry)
    from model import GPT  # noqa: E402  (gpt_setup put examples/gpt on the path)

    numel = sum(p.numel() for p in GPT(cfg).parameters())
    x = torch.randn(numel, device=device)
    out: Dict[str, Any] = {"params": numel, "fp32_bytes": 4 * numel, "kinds": list(KINDS)}
    for kind in KINDS:
        packed = torch.empty(packed_size(numel, 256, kind), dtype=torch.uint8, device=device)
        q_s, d_s = [], []
        for i in range(repeats + 1):
            synchronize(device)
            t0 = time.perf_counter()
            quantize(x, kind, 256, packed)
            synchronize(device)
            t1 = time.perf_counter()
            y = dequantize(packed, kind, 256, numel)
            synchronize(device)
            if i:
                q_s.append(t1 - t0)
                d_s.append(time.perf_counter() - t1)
        out[kind] = {"quantize_ms": 1e3 * statistics.median(q_s), "dequantize_ms": 1e3 * statistics.median(d_s),
                     "max_rel_error": float((y - x).abs().max() / x.abs().max()), "packed_bytes": packed.numel()}
    return out


def _quantize_lines(o: Dict[str, Any], dry: bool) -> List[str]:
    kinds = o.get("kinds", ["int8", "fp8"])
    rows = [f"One round's gradients of {o['params'] / 1e6:.1f}M parameters ({o['fp32_bytes'] / 1e6:.0f} MB in fp32), "
            "blocks of 256, median of the timed runs:", "",
            "| kind | MB packed | quantize ms | dequantize ms | max error / max value |", "|---|---|---|---|---|"]
    rows += [f"| {k} | {o[k].get('packed_bytes', o.get('packed_bytes', 0)) / 1e6:.0f} | {o[k]['quantize_ms']:.3f} | "
             f"{o[k]['dequantize_ms']:.3f} | {o[k]['max_rel_error']:.2g} |" for k in kinds]
    return rows


_SECTIONS = [  # (results key, heading, lines of a section that did not raise)
    ("tests", "### 1. CUDA tests", _tests_lines),
    ("trace", "### 2. Profiler trace (4 updates of 4 micro-batches, mode acco)", _trace_lines),
    ("overhead", "### 3. Per-update time, ACCO vs plain AdamW (one device)", _overhead_lines),
    ("compile", lambda c: f"### 4. torch.compile ({c.get('backend', 'inductor')} backend)", _compile_lines),
    ("memory", "### 5. Memory against docs/algorithm.md", _memory_lines),
    ("syncs", "### 6. Host synchronisations after the first applied step", _syncs_lines),
    ("errors", "### 7. A device-found error on two ranks", _errors_lines),
    ("exits", "### 8. How a process ends without finish()", _exits_lines),
    ("gpt", lambda o: f"### 9. Per-update time at {o.get('tokens_per_update', 65536):,} tokens per update, ACCO vs "
                      "plain AdamW (one device)", _gpt_lines),
    ("dtensor", "### 10. DTensor parameters (tensor parallelism, FSDP2) on the device", _dtensor_lines),
    ("quantize", "### 11. Compressed rounds: quantizing one round's gradients", _quantize_lines),
]


def render(results: Dict[str, Any], dry: bool, device: str, argv: Sequence[str]) -> str:
    r = results
    lines = [
        BEGIN,
        "",
        f"Produced by `python benchmarks/gpu_check.py {' '.join(argv)}` on {r['device_name']}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}.",
    ]
    if dry:
        lines += ["", "**Dry run on CPU: no GPU was used. Nothing below is a GPU measurement; it shows that the "
                      "script runs end to end.**"]
    for key, title, body in _SECTIONS:
        if key not in r:
            continue  # left out by --only
        x = r[key]
        lines += ["", title(x) if callable(title) else title, ""]
        if "error" in x:
            lines.append(f"**Raised** `{x['error']}`:")
            lines += ["", "```", *x["traceback"], "```"]
        else:
            lines += body(x, dry)
    failures = r["failures"]
    lines += ["", "### Verdict", "", "PASS" if not failures else "FAIL: " + "; ".join(failures)]
    lines += ["", END]
    return "\n".join(lines) + "\n"


def write_report(path: Path, block: str) -> None:
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) + 1 :]
    else:
        text = text + ("\n" if text else "") + block
    path.write_text(text)


def main(argv: Sequence[str] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="run every section on the CPU with a tiny model")
    p.add_argument("--out", type=Path, default=None,
                   help="report file whose gpu_check block is rewritten (default: docs/studies/gpu-runs.md; none on a dry run)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--only", default=None, help="comma-separated sections to run (default: all), e.g. exits,dtensor: "
                                                "a short check when little device time is left")
    p.add_argument("--exit-script", choices=EXIT_CASES, help=argparse.SUPPRESS)  # check_exits' child
    p.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)  # the child uses torch's AdamW
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.exit_script:
        _exit_script(args.device, args.exit_script, args.reference)
        return {}
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU machine, or pass --dry-run")
    device = "cpu" if dry else "cuda"
    width, layers, batch = (32, 2, 4) if dry else (4096, 8, 16)
    results: Dict[str, Any] = {"device_name": "CPU (dry run)" if dry else torch.cuda.get_device_name()}
    if not dry and not torch.distributed.is_initialized():
        # A process group of one on NCCL: the rounds' collectives run as NCCL kernels, through torch's NCCL
        # streams, as on a cluster (without one they would be local copies).
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                             device_id=torch.device("cuda", torch.cuda.current_device()))
    runs = {  # results key -> its check and arguments, in the report's order
        "tests": (check_tests,),
        "trace": (check_trace, width, layers, batch, device, dry),
        "overhead": (check_overhead, width, layers, batch, device, args.repeats or (1 if dry else 5), 2 if dry else 20),
        "compile": (check_compile, width, layers, batch, device, dry),
        "memory": (check_memory, width, layers, batch, device),
        "syncs": (check_syncs, width, layers, batch, device),
        "errors": (check_error_step, device),
        "exits": (check_exits, device),
        "gpt": (check_gpt_overhead, device, dry, args.repeats or (1 if dry else 5)),
        "dtensor": (check_dtensor, device),
        "quantize": (check_quantize, device, dry, args.repeats or (2 if dry else 10)),
    }
    only = [k for k in args.only.split(",") if k] if args.only else list(runs)
    unknown = sorted(set(only) - set(runs))
    if unknown:
        p.error(f"--only got unknown sections {unknown}; choose from {','.join(runs)}")
    for key in runs:
        if key in only:
            results[key] = section(*runs[key])
    results["failures"] = verdict(results, dry)
    block = render(results, dry, device, argv)
    out = args.out if args.out is not None else (None if dry else ROOT / "docs" / "studies" / "gpu-runs.md")
    if out is not None:
        write_report(out, block)
    print(block)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if results["failures"]:
        raise SystemExit("gpu_check FAILED:\n- " + "\n- ".join(results["failures"]))
    return results


if __name__ == "__main__":
    main()
