"""Mutation check: break one ordering or check of the library at a time and show that a test fails.

Run from the repository root: ``.venv/bin/python tests/mutations.py [M1 M3 ...]``. Each line prints the
targeted tests' outcome with the mutation in place (a failure is the expected result); the source is
restored afterwards. Not collected by pytest.
"""
import subprocess, sys
cases = [
 ("M1 no theta_t install at the estimate hand-off", "src/acco/driver.py",
  "        self.install_pending()  # the previous round's weights are the model's for the micro-batches after this hand-off",
  "        self.install_pending() if kind is RoundKind.COMMIT else None",
  "tests/test_update_equivalence.py"),
 ("M2 estimate not extrapolated", "src/acco/loops.py",
  "m / (p.mb_in_update * opt.world_size))", "1.0 / opt.world_size)", "tests/test_update_equivalence.py"),
 ("M3 end-of-backward not re-queued behind DDP", "src/acco/optimizer.py",
  "        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)",
  "        self._after_backward()", "tests/test_dropin.py -k ddp"),
 ("M5 checksums not verified", "src/acco/checksums.py",
  "        if int(got[key]) != int(value):", "        if False:", "tests/test_checkpoint_corruption.py"),
 ("M6 no agreement before a collective load", "src/acco/shard_state.py",
  "    _agree(opt, error)", "    if error is not None:\n        raise error", "tests/test_dropin.py -k shard"),
 ("M7 committed_weights does not swap", "src/acco/optimizer.py",
  "        swap = self._progress.pending is RoundKind.COMMIT\n", "        swap = False\n", "tests/test_update_equivalence.py"),
 ("M8 finish after a failure does its collective", "src/acco/optimizer.py",
  "        if self._failed is not None:  # no collective, no wait: a peer may be gone", "        if False:", "tests/test_fault_paths.py"),
 ("M9 moved .grad not re-bound", "src/acco/grads.py",
  "        if g is not None and not g.is_sparse and g.data_ptr() == self._ptrs[i]:", "        if True:", "tests/test_dropin.py -k same_device"),
 ("M10 hyper-parameter fingerprint not checked", "src/acco/rounds.py",
  "    if not bool((pairs[:, 1] == pairs[0, 1]).all()):", "    if False:", "tests/test_errors.py -k hyper_parameters_changed"),
 ("M11 round ids not compared", "src/acco/rounds.py",
  "    if len(set(ids)) > 1:", "    if False:", "tests/test_errors.py -k different_rounds"),
 ("M12 reentrant backward not refused", "src/acco/optimizer.py",
  "            hooks.refuse_reentrant_backward()\n", "", "tests/test_dropin.py -k checkpointing"),
 ("M13 no exit handler", "src/acco/optimizer.py",
  "        hooks.LIVE.add(self)  # closed at interpreter exit if finish() never came", "        pass", "tests/test_dropin.py -k exit_without"),
 ("M14 clipping of .grad not detected", "src/acco/grads.py",
  "        if strict and self.buffer._version != self._version:", "        if False:", "tests/test_dropin.py -k clipping"),
 ("M15 hand-off event on the current device's stream", "src/acco/scheduler.py",
  "        timing.submit.record(compute)\n", "        timing.submit.record()\n", "tests/test_stream_protocol.py -k device-1"),
 ("M16 side stream does not wait for the hand-off", "src/acco/scheduler.py",
  "        side.wait_event(timing.submit)\n", "", "tests/test_stream_protocol.py -k oracle"),
 ("M17 compute stream does not wait for the round", "src/acco/scheduler.py",
  "            compute.wait_event(timing.end)\n", "", "tests/test_stream_protocol.py -k oracle"),
 ("M18 no end event on the side stream", "src/acco/scheduler.py",
  "            timing.end.record(side)  # side stream: the round's weights are in its output buffer\n", "",
  "tests/test_stream_protocol.py -k oracle"),
 ("M19 round tensors not record_stream-ed", "src/acco/scheduler.py",
  "            api.record_stream(tensor, side)\n", "            pass\n", "tests/test_stream_protocol.py -k oracle"),
 ("M20 the host does not wait for the last round (finish, reports)", "src/acco/scheduler.py",
  "            self._last_end.synchronize()\n", "            pass\n", "tests/test_stream_protocol.py -k finish_waits"),
 ("M21 skip decided on the host on the CUDA path", "src/acco/rounds.py",
  "            undo = flags.any()\n", "            skipped = bool(nonfinite_flag)\n", "tests/test_stream_protocol.py -k oracle"),
 ("M22 reports read before the device wrote them", "src/acco/driver.py",
  "            self.scheduler.host_wait(end)\n", "", "tests/test_stream_protocol.py -k same_step"),
 ("M23 no start event of a round", "src/acco/scheduler.py",
  "            timing.start.record(side)  # side stream: the round begins (for round_s only)\n", "",
  "tests/test_stream_protocol.py -k oracle"),
 ("M24 no event after the history's host copy", "src/acco/scheduler.py",
  "        event.record(self._api.current_stream(self.device))  # compute stream: after the work issued so far\n", "",
  "tests/test_stream_protocol.py -k oracle"),
 ("M25 no wait-begin event", "src/acco/scheduler.py",
  "            timing.wait_begin.record(compute)  # compute stream: what it had to do before needing the round\n", "",
  "tests/test_stream_protocol.py -k oracle"),
 ("M26 no wait-end event", "src/acco/scheduler.py",
  "            timing.wait_end.record(compute)  # compute stream: resumes after the round (for wait_s only)\n", "",
  "tests/test_stream_protocol.py -k oracle"),
 ("M27 .grad changed in place between backward passes not followed (bf16, fp32 sum)", "src/acco/buffers.py",
  "                self.accum.copy_(self.grads)\n", "                pass\n", "tests/test_gpu_defects.py -k discards"),
 ("M28 Opt* output written before its gradient is read", "src/acco/functional.py",
  "    covered = 0  # pieces are in master order", "    out.copy_(master)\n    covered = 0  # pieces are in master order",
  "tests/test_functional.py"),
 ("M29 Opt* by snapshot not restored", "src/acco/rounds.py",
  "        snapshot.restore(optimizer, params, b.master)  # Opt*: leave theta and state untouched\n", "        pass\n",
  "tests/test_functional.py -k oracle"),
 ("M30 the round's row written with Python scalars (a blocking copy on CUDA)", "src/acco/rounds.py",
  "        b.row[i].fill_(value)\n", "        b.row[i] = value\n", "tests/test_stream_protocol.py -k oracle"),
 ("M31 device reports read whenever the device happens to be done", "src/acco/driver.py",
  "        while self._unread and (upto is None or self._unread[0][0] <= upto):",
  "        while self._unread and (upto is None or self._unread[0][1].query()):",
  "tests/test_stream_protocol.py -k same_step"),
 ("M32 only a non-finite gradient undone on the device", "src/acco/rounds.py",
  "            undo = flags.any()\n", "            undo = nonfinite_flag\n", "tests/test_stream_protocol.py -k undone"),
 ("M33 round group connected lazily", "src/acco/optimizer.py",
  "            connect(round_group, device)", "            pass", "tests/test_stream_protocol.py -k connected"),
 ("M34 estimate_microbatches ignored", "src/acco/loops.py",
  "        return self.opt.estimate_microbatches or m // 2", "        return m // 2",
  "tests/test_update_equivalence.py -k estimate"),
 ("M35 synchronous_updates ignored at step()", "src/acco/loops.py",
  "        synchronous = opt.mode == \"sync\" or p.commits_handed_off < opt.synchronous_updates",
  "        synchronous = opt.mode == \"sync\"", "tests/test_update_equivalence.py -k sync2"),
 ("M36 estimate handed off during the synchronous updates", "src/acco/loops.py",
  "\n                and p.commits_handed_off >= opt.synchronous_updates):", "):",
  "tests/test_update_equivalence.py -k acco/m2-sync2"),
 ("M37 fused AdamW undone by a snapshot", "src/acco/rounds.py",
  "    in_kernel = kind is RoundKind.COMMIT and ctx.device_checks and skips_in_kernel(optimizer)",
  "    in_kernel = False", "tests/test_stream_protocol.py -k fused_adamw_skips"),
 ("M38 found_inf not given to the fused kernel", "src/acco/rounds.py",
  "                optimizer.found_inf = undo.to(torch.float32)  # where set, the fused kernel takes no step at all",
  "                pass", "tests/test_stream_protocol.py -k fused_adamw_skips"),
]
only = sys.argv[1:]
for name, path, old, new, tests in cases:
    if only and name.split()[0] not in only:
        continue
    src = open(path).read()
    assert src.count(old) == 1, (name, src.count(old))
    open(path, "w").write(src.replace(old, new))
    try:
        r = subprocess.run(f"OMP_NUM_THREADS=1 timeout 600 .venv/bin/python -m pytest -q -x {tests}", shell=True,
                           capture_output=True, text=True)
        last = [l for l in r.stdout.splitlines() if "passed" in l or "failed" in l or "error" in l.lower()][-1:]
        print(f"{name}: exit {r.returncode} {last}", flush=True)
    finally:
        open(path, "w").write(src)
