"""Runs on two hosts: two network namespaces joined by a veth pair, each running ``torchrun --nnodes=2`` with a
c10d rendezvous at the first host's address, training ``examples/gpt/train.py`` with checkpoints.

* a host's worker killed with SIGKILL after a checkpoint: torchrun (``--max-restarts=1``) restarts both hosts'
  workers, they resume from the latest complete checkpoint (``--resume auto``) and end bit-identical to the
  uninterrupted run of the same world size on one host, in mode acco (so the two-host run itself is
  bit-identical to the one-host run); the recovery time and the updates recomputed are printed;
* the same kill while a checkpoint is being saved: the run resumes from the previous one.

Needs root (network namespaces): without it the tests skip with the reason, except under ``CI=true``, where a
skip is a failure (CI must run them).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import _hosts as H
from _dist import run_command

HERE = os.path.dirname(__file__)
TRAIN = os.path.join(HERE, "..", "examples", "gpt", "train.py")
WHY = H.unavailable()
if WHY and os.environ.get("CI") == "true":
    raise RuntimeError(f"tests/test_cluster.py cannot run here ({WHY}); under CI=true it must")
pytestmark = [pytest.mark.skipif(WHY is not None, reason=WHY or ""),
              pytest.mark.slow]  # make test-all only: two hosts on network namespaces


def _args(mode: str, ckpt: str, out: str, steps: int = 40) -> list:
    # rank 0 sleeps 9x its compute after each micro-batch (--slow-rank: numerics unchanged, one micro-batch per
    # rank and round) and the run has 40 updates, so a kill just after the first checkpoint (update 4) lands well
    # before the end (a kill after a host's worker finished would leave the other host's agent waiting for a
    # rendezvous that never comes: 16 updates in mode sync were once over 0.3 s after the first checkpoint)
    return [TRAIN, f"--optimizer={mode}", f"--steps={steps}", "--batch=4", "--seq-len=32", "--d-model=32", "--layers=1",
            "--eval-every=8", "--log-every=2", "--no-progress", f"--ckpt-dir={ckpt}", "--ckpt-every=4",
            f"--out={out}", "--resume=auto", "--slow-rank=0", "--slow-factor=10"]


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """The uninterrupted run of each mode on one host (2 ranks, --standalone): the reference."""
    cache = {}

    def get(mode: str) -> dict:
        if mode not in cache:
            tmp = tmp_path_factory.mktemp(f"one-host-{mode}")
            run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                         *_args(mode, str(tmp / "ck"), str(tmp / "out"))], timeout=240)
            cache[mode] = torch.load(os.path.join(tmp / "out", "final.pt"), weights_only=True)
        return cache[mode]

    return get


@pytest.fixture()
def hosts():
    H.up()
    yield
    H.down()


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _checkpoints(ckpt_dir: str) -> list:
    """The latest complete checkpoint, as a list (empty: none yet)."""
    import acco.checkpoint

    latest = acco.checkpoint.latest(ckpt_dir)
    return [] if latest is None else [latest]


def _records(text: str, key: str) -> list:
    """The example's JSON lines that open with ``key`` (its resume and first-resumed-update records)."""
    return [json.loads(m) for m in re.findall(r'^(\{"' + key + r'".*\})$', text, re.M)]


def _kill_and_restart(tmp_path, mode: str, when, extra_args=()) -> tuple:
    """Two hosts with --max-restarts=1; once ``when(ckpt_dir)`` holds, host 1's worker gets SIGKILL. Returns the
    final weights, the resume record, and the report line."""
    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "two-hosts")
    logs = [open(tmp_path / f"h{i}.log", "w") for i in range(2)]
    agents = [H.torchrun(i, [*_args(mode, ckpt, out), *extra_args], max_restarts=1, rdzv_id=f"kill-{mode}",
                         log=logs[i]) for i in range(2)]
    try:
        deadline = time.time() + 120
        while not when(ckpt) and time.time() < deadline:
            time.sleep(0.02)
        assert when(ckpt), "the moment to kill never came"
        victims = H.workers(agents[1])
        assert victims, "host 1 has no worker to kill"
        killed_at = time.time()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)  # the host's worker dies: no cleanup, no finish()
        H.wait_all(agents, 240)
    finally:
        H.kill_all(agents)
    text = "".join((tmp_path / f"h{i}.log").read_text() for i in range(2))
    assert [a.returncode for a in agents] == [0, 0], text[-4000:]
    resumed, first = _records(text, "resumed_from"), _records(text, "first_update_after_resume")
    assert resumed and first, text[-4000:]
    before_kill = text.split('{"resumed_from"')[0]
    reached = max(json.loads(m)["step"] for m in re.findall(r'^(\{"step".*\})$', before_kill, re.M))
    report = (f"{mode}: killed host 1's worker after update {reached} (rank 0's last log line); resumed from update "
              f"{resumed[-1]['update']}, first resumed update {first[-1]['unix_time'] - killed_at:.1f} s after the "
              f"kill; at least {reached - resumed[-1]['update']} update(s) recomputed")
    print("\n" + report)
    return torch.load(os.path.join(out, "final.pt"), weights_only=True), resumed[-1]


# Mode acco only: its state is the larger (a commit in flight, theta~ in the model). Mode sync ran here too until
# 2026-11-25 (docs/cluster.md keeps its figures); what is left for sync is a weaker check, in-process
# (tests/test_checkpoint.py: saved on 3 ranks, resumed on 2); the example's save/resume has no mode-specific code.
@pytest.mark.parametrize("mode", ["acco"])
def test_a_host_killed_after_a_checkpoint_restarts_and_ends_bit_identical(hosts, tmp_path, mode, one_host):
    def after_first_checkpoint(ckpt):
        if not _checkpoints(ckpt):
            return False
        time.sleep(0.05)  # an update or two past it
        return True

    final, resumed = _kill_and_restart(tmp_path, mode, after_first_checkpoint)
    assert _equal(final, one_host(mode))


def test_a_host_killed_while_saving_resumes_from_the_previous_checkpoint(hosts, tmp_path, one_host):
    """The kill lands while the checkpoint of update 8 is being saved (each rank's write made 2 s slower), after
    DCP wrote its .metadata but before every rank finished and the folder was marked complete and renamed: that
    folder is not used, the run resumes from update 4 and still ends bit-identical."""
    def saving_update_8(ckpt):
        return os.path.exists(os.path.join(ckpt, "update_0000008.tmp", ".metadata"))

    final, resumed = _kill_and_restart(tmp_path, "acco", saving_update_8, ["--slow-ckpt-write=2"])
    assert resumed["update"] == 4, resumed
    assert _equal(final, one_host("acco"))


def _shrink_args(ckpt: str, out: str, seed: int = 0) -> list:
    # 32 updates at a rate where 32 make a visible difference; 2 micro-batches per round over all ranks, whatever
    # their number (--global-microbatches: the global batch survives the shrink); host 1's rank is the slow one,
    # so the run lasts until the kill and the single host finishes fast
    return [TRAIN, "--optimizer=acco", "--steps=32", "--batch=4", "--seq-len=32", "--d-model=32", "--layers=1",
            "--lr=1e-2", "--eval-every=8", "--log-every=2", "--no-progress", "--global-microbatches=2",
            f"--seed={seed}", f"--ckpt-dir={ckpt}", "--ckpt-every=4", f"--out={out}", "--resume=auto",
            "--slow-rank=1", "--slow-factor=10"]


def test_a_host_lost_for_good_the_other_goes_on_alone_within_the_seed_spread(hosts, tmp_path):
    """``--nnodes=1:2``: once a checkpoint exists, host 1's agent and worker are killed and never return. Host
    0's worker fails, its agent restarts it in a one-host round (after host 1's heartbeats expire), the worker
    reshards the 2-rank checkpoint onto 1 rank, keeps the global batch (2 micro-batches per round, now both its
    own) and finishes. Its final held-out loss must lie within the seed spread of uninterrupted 1-rank runs."""
    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "shrunk")
    logs = [open(tmp_path / f"h{i}.log", "w") for i in range(2)]
    # a lost host is noticed after 3 missed 1 s heartbeats; a round closes 3 s after its first MIN hosts joined
    conf = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
    agents = [H.torchrun(i, _shrink_args(ckpt, out), nnodes="1:2", max_restarts=1, rdzv_id="shrink",
                         rdzv_conf=conf, log=logs[i]) for i in range(2)]
    try:
        deadline = time.time() + 120
        while not _checkpoints(ckpt) and time.time() < deadline:
            time.sleep(0.02)
        assert _checkpoints(ckpt), "no checkpoint was written"
        killed_at = time.time()
        H.kill_all([agents[1]])  # host 1 is gone: its agent and worker, for good
        H.wait_all([agents[0]], 240)
    finally:
        H.kill_all(agents)
    text = "".join((tmp_path / f"h{i}.log").read_text() for i in range(2))
    assert agents[0].returncode == 0, text[-4000:]
    resumed, first = _records(text, "resumed_from"), _records(text, "first_update_after_resume")
    assert resumed and first, text[-4000:]
    assert (resumed[-1]["saved_ranks"], resumed[-1]["ranks"]) == (2, 1), resumed
    summary = json.loads((tmp_path / "shrunk" / "summary.json").read_text())
    assert (summary["world"], summary["updates"]) == (1, 32), summary
    # every round after the shrink held 2 micro-batches, the global batch of the 2-rank rounds before it
    assert set(summary["microbatches_per_round"][0][-8:]) <= {2, 4}, summary["microbatches_per_round"]

    references = []
    for seed in range(3):  # the smaller world size, uninterrupted (no process group: one process)
        ref = tmp_path / f"ref{seed}"
        run_command([sys.executable, TRAIN, *_shrink_args(str(ref / "ck"), str(ref), seed)[1:]], timeout=120)
        references.append(json.loads((ref / "summary.json").read_text())["final_eval_loss"])
    lo, hi = min(references), max(references)
    print(f"\nshrink: resumed on 1 rank from update {resumed[-1]['update']} of a 2-rank run, first update "
          f"{first[-1]['unix_time'] - killed_at:.1f} s after host 1 was killed; final held-out loss "
          f"{summary['final_eval_loss']:.4f}, uninterrupted 1-rank seeds 0-2: {', '.join(f'{r:.4f}' for r in references)}")
    assert lo - (hi - lo) <= summary["final_eval_loss"] <= hi + (hi - lo), (summary["final_eval_loss"], references)
