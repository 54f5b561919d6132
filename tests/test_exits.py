"""How a training process ends: every way a program ends exits with the code it meant, on every rank, promptly,
and with nothing printed by a C++ runtime ("terminate called without an active exception").

Each test launches a real script under torchrun (2 gloo ranks) and ends it one way: ``tests/loop_script.py`` (a
``main()`` that trains modes acco, dpu, sync and accumulate-while-communicating side by side and returns without
``finish()``), or an integration's script, wrapped by ``tests/ending.py``, which ends it at a given ``step()``.
Where a test asserts every rank's own exit code after a failure, the ranks are started directly with torchrun's
environment: torchrun sends SIGTERM to the survivors of the first rank that fails, so under it a rank a moment
slower than its peer reports -15 instead of its own code (seen in CI with Lightning, rank 0 still unwinding).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
LIMIT = 240  # seconds a launch may take (a hang fails the test)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(*args: str, torchrun: bool = True, sig: Optional[int] = None, to_launcher: bool = False,
            env: Optional[Dict[str, str]] = None, limit: float = LIMIT) -> Tuple[int, Dict[int, int], str]:
    """Run ``ending.py ARGS`` on 2 ranks; return (the launcher's exit code, each rank's exit code, the output).

    ``torchrun``: under torchrun in a session of its own; each rank's code is read from torchrun's report of the
    ranks that failed (every rank exited 0 when torchrun did). Else each rank is started directly, with the
    environment torchrun gives it, so that the test holds every rank's own exit code (torchrun reports none
    when it is itself signalled). ``sig``: once every rank printed READY, send this signal to every process of
    the job (as a terminal's Ctrl-C does) or, with ``to_launcher``, to torchrun alone (which forwards it to its
    ranks, as when a peer failed or the job is preempted). A launch longer than ``limit`` s fails the test.
    """
    base = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    # Ctrl-C as a terminal sends it, even when this test runs in a background job (whose shell ignores SIGINT,
    # and an ignored signal stays ignored in its children: Python would then install no KeyboardInterrupt)
    default_sigint = dict(preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    script = [os.path.join(HERE, "ending.py"), *args]
    if torchrun:
        procs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             "--monitor-interval=2", *script],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=base, start_new_session=True,
            **default_sigint)]
    else:
        port, procs = str(_free_port()), []
        for rank in range(2):
            rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            procs.append(subprocess.Popen([sys.executable, *script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, env=rank_env, **default_sigint))
    lines: List[str] = []
    deadline = time.monotonic() + limit
    try:
        _read_all(procs, lines, sig, to_launcher, torchrun, deadline)
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if torchrun:
                os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks (a session of their own)
            else:
                proc.kill()
            proc.wait()
        raise AssertionError(f"{args} did not end within {limit} s:\n{''.join(lines)[-4000:]}") from None
    out = "".join(lines)
    if torchrun:
        rc = procs[0].returncode
        return rc, (_rank_codes(out) if rc != 0 else {0: 0, 1: 0}), out
    return 0, {rank: proc.returncode for rank, proc in enumerate(procs)}, out


def _read_all(procs, lines: List[str], sig, to_launcher: bool, torchrun: bool, deadline: float) -> None:
    """Collect every process's output (a thread each), and send ``sig`` once both ranks said READY."""
    import threading

    ready = threading.Semaphore(0)

    def read(proc) -> None:
        for line in proc.stdout:
            lines.append(line)
            # Every READY in the line: under torchrun both ranks write to one pipe, and two ranks' lines can
            # land in one ("READY rank 0READY rank 1"); counting lines missed the second and never signalled.
            for _ in range(line.count("READY")):
                ready.release()

    readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in procs]
    for reader in readers:
        reader.start()
    if sig is not None:
        for _ in range(2):
            if not ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise subprocess.TimeoutExpired("READY", LIMIT)
        time.sleep(1.0)  # every rank's training thread is now waiting for the slowed round (3 s)
        if torchrun and not to_launcher:
            os.killpg(procs[0].pid, sig)  # torchrun and its ranks: one process group
        else:
            for proc in procs:
                proc.send_signal(sig)
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))


def _rank_codes(out: str) -> Dict[int, int]:
    """Each failed rank's exit code from torchrun's report (a negative code: the signal that ended it)."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", out)
    return {int(r): int(c) for r, c in found}


def _clean(out: str) -> None:
    """Nothing printed by a C++ runtime, no abort."""
    for sign in ("terminate called", "core dumped", "Aborted", "exitcode  : -6", "exitcode  : 134"):
        assert sign not in out, f"{sign!r} in:\n{out[-4000:]}"


LOOP = os.path.join(HERE, "loop_script.py")


def test_ctrl_c_while_waiting_keeps_the_round_in_flight():
    """Ctrl-C while the training thread waits for a round (CPU path): the wait raises KeyboardInterrupt and the
    round, still running on the worker, stays in flight, so that the exit lets it end before its group goes
    (``settle`` waits for it). Dropped, the exit would find nothing in flight and release the group under it.
    Deterministic: the round blocks until the test lets it go, and the interrupt is delivered during the wait."""
    import threading

    import torch

    from acco.scheduler import StreamScheduler

    sched, release = StreamScheduler(torch.device("cpu")), threading.Event()
    sched.submit(lambda: release.wait(30) and "ended")

    def send() -> None:
        os.kill(os.getpid(), signal.SIGINT)

    def interrupt(signum, frame):
        inside = frame
        while inside is not None and inside.f_code is not StreamScheduler.wait.__code__:
            inside = inside.f_back
        if inside is None:  # not yet inside wait() (a slow machine): interrupt it a moment later
            threading.Timer(0.05, send).start()
            return
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        threading.Timer(0.2, send).start()
        with pytest.raises(KeyboardInterrupt):
            sched.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sched.in_flight  # the round is still running: not forgotten
    assert not sched.settle(timeout=0.2)  # the exit's wait sees it and is not done yet
    release.set()
    assert sched.settle(timeout=10.0)
    assert sched.wait() == "ended"  # collected once it ended
    sched.close()


def test_return_from_main_without_finish():
    """The README's loop in a ``main()`` that returns: no finish(), no destroy_process_group(), a round in flight
    in modes acco, dpu and accumulate-while-communicating. Before the fix: 134 (SIGABRT) on every rank."""
    rc, codes, out = _launch("none", "0", LOOP, "6")
    _clean(out)
    assert rc == 0 and codes == {0: 0, 1: 0}, out[-4000:]
    assert out.count("rounds in flight: 3") == 2, out[-3000:]  # acco, dpu, awc each left a round running


@pytest.mark.parametrize("how,code", [("exit", 3), ("raise", 1), ("raise-between", 1)])
@pytest.mark.slow
def test_exit_and_exceptions_inside_a_function(how, code):
    """``sys.exit(3)``, and an exception from user code after a step (a round in flight) or between the
    micro-batches of an update, end every rank with 3 or 1 (Python's code for an uncaught exception)."""
    _, codes, out = _launch(how, "9", LOOP, "6", torchrun=False)  # call 9 of step(): update 2's, mode dpu's loop
    _clean(out)
    assert codes == {0: code, 1: code}, out[-4000:]
    if how != "exit":
        assert out.count("UserError") >= 2, out[-3000:]  # the user's own traceback, not one of the library's


@pytest.mark.slow
def test_an_exception_under_torchrun():
    """The same exception under torchrun: torchrun fails with the user's error, no rank aborted, and each rank
    reports either its own code 1 or the SIGTERM torchrun sends the survivors of the first to fail."""
    rc, codes, out = _launch("raise", "9", LOOP, "6")
    _clean(out)
    assert rc != 0 and 1 in codes.values() and set(codes.values()) <= {1, -signal.SIGTERM}, out[-4000:]
    assert "UserError" in out, out[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("torchrun", [False, True], ids=["direct", "torchrun"])
@pytest.mark.slow
def test_a_signal_in_the_middle_of_a_round(sig, torchrun):
    """Ctrl-C (SIGINT to every process of the job) or SIGTERM (from torchrun, as when a peer failed or the job is
    preempted; or from a scheduler to each rank) while a round is in flight: every rank ends by that signal,
    promptly, without a C++ abort. Ranks started directly: each one's exit code is the signal's. Under torchrun
    (which reports no rank's code when it is signalled itself): torchrun fails, and no rank aborted."""
    rc, codes, out = _launch("signal", "9", LOOP, "400", torchrun=torchrun, sig=sig,
                             to_launcher=sig == signal.SIGTERM, limit=120)  # promptly: a hang fails the test
    _clean(out)
    assert "READY" in out and "trained 400 updates" not in out, out[-3000:]
    if torchrun:
        assert rc != 0 and f"got signal: {int(sig)}" in out, out[-3000:]
    else:
        assert codes == {0: -sig, 1: -sig}, out[-4000:]
    if sig == signal.SIGINT:
        assert out.count("KeyboardInterrupt") >= 2, out[-3000:]  # the user's own interrupt, not a RoundFailedError
        assert "RoundFailedError" not in out, out[-3000:]


@pytest.mark.slow
def test_a_signal_while_a_checkpoint_is_written(tmp_path):
    """SIGTERM to each rank while every update writes an acco.checkpoint: every rank ends by it, and
    ``acco.checkpoint.latest`` picks a complete checkpoint (never the one cut off), which loads."""
    import acco.checkpoint
    from tinynet import make_model

    from acco import AccoOptimizer

    _, codes, out = _launch("signal", "11", LOOP, "400", "--ckpt", str(tmp_path), torchrun=False, sig=signal.SIGTERM)
    _clean(out)
    assert codes == {0: -signal.SIGTERM, 1: -signal.SIGTERM}, out[-4000:]
    path = acco.checkpoint.latest(str(tmp_path))
    assert path is not None, os.listdir(tmp_path)
    model = make_model(1)
    opt = AccoOptimizer(model.parameters(), lr=1e-2)
    acco.checkpoint.load(path, opt, model=model)  # a whole checkpoint: loads (on one process), checksums verified
    assert opt.next_update_index == int(path.rsplit("_", 1)[1]) + 1
    opt.finish()


INTEGRATIONS = {
    "hf-trainer": ("hf_trainer_script.py", "{out}", "acco"),
    "accelerate": ("accelerate_script.py", "{out}", "acco"),
    "lightning": ("lightning_script.py", "--out", "{out}/result.json"),
}


def _integration(name: str, tmp_path) -> List[str]:
    script, *args = INTEGRATIONS[name]
    return [os.path.join(HERE, script), *(a.format(out=tmp_path) for a in args)]


@pytest.mark.parametrize("name", list(INTEGRATIONS))
@pytest.mark.slow
def test_an_exception_inside_an_integration(name, tmp_path):
    """An exception from user code (a callback, a training step) while a round is in flight, under HF's Trainer,
    accelerate and Lightning: every rank exits 1, with the user's exception."""
    _, codes, out = _launch("raise", "5", *_integration(name, tmp_path), torchrun=False)
    _clean(out)
    assert codes == {0: 1, 1: 1}, out[-4000:]
    assert out.count("UserError") >= 2, out[-3000:]


# What each integration means by Ctrl-C: Lightning catches it ("attempting graceful shutdown", then sys.exit(1));
# the others leave it to Python. (Lightning's SIGTERM handling is not here: it checks its received_sigterm flag on
# each rank separately, so ranks can stop one batch apart and the rank left training sees its peer gone.)
MEANT = {("hf-trainer", signal.SIGINT): -signal.SIGINT, ("accelerate", signal.SIGINT): -signal.SIGINT,
         ("lightning", signal.SIGINT): 1}


@pytest.mark.parametrize("name,sig", list(MEANT), ids=[f"{n}-{s.name}" for n, s in MEANT])
@pytest.mark.slow
def test_a_signal_inside_an_integration(name, sig, tmp_path):
    """Ctrl-C, or SIGTERM to each rank, while a round is in flight under an integration: every rank ends as the
    integration means it to (``MEANT``), without a C++ abort or a round error."""
    _, codes, out = _launch("signal", "5", *_integration(name, tmp_path), torchrun=False, sig=sig)
    _clean(out)
    assert codes == {0: MEANT[name, sig], 1: MEANT[name, sig]}, out[-4000:]
    assert "RoundFailedError" not in out, out[-3000:]


def _holders_worker(rank: int, world: int) -> dict:
    """What of a finished optimizer still references the rounds' own group (or the model group)."""
    import gc

    import torch
    from acco import AccoOptimizer

    model = torch.nn.Linear(4, 2)
    opt = AccoOptimizer(model.parameters(), lr=1e-2, mode="sync")
    rounds = opt.runtime.driver.ctx.group
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.finish()
    seen, stack, paths = set(), [(opt, "opt")], []
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if obj is rounds:
            paths.append(path)
            continue
        module = type(obj).__module__ or ""
        if not (module.startswith("acco") or isinstance(obj, (dict, list, tuple, set, frozenset))
                or callable(obj) and module.startswith("functools")):
            continue
        for ref in gc.get_referents(obj):
            stack.append((ref, f"{path} -> {type(ref).__name__}"))
    return {"was_a_group": rounds is not None, "held_by": paths}


def test_a_finished_optimizer_holds_no_round_group():
    """finish() releases the rounds' own group: nothing of the optimizer keeps the ProcessGroup object alive
    (one left to interpreter finalisation aborts the process, "terminate called without an active
    exception", as an HF Trainer run once did when the runtime kept a second reference)."""
    from _dist import run_ranks

    for rank, r in enumerate(run_ranks(_holders_worker, 2)):
        assert r["was_a_group"], "the test needs a round group"
        assert r["held_by"] == [], (rank, r["held_by"])
