"""StreamScheduler: where a communication round runs, and how it is ordered with compute.

Two paths, chosen by the parameters' device:

* **CPU** (gloo, or no process group): the round runs on one background worker
  thread. gloo's collectives and PyTorch's CPU kernels release the GIL, so it
  really runs while the training thread computes the next backward. Host
  synchronisation is free here (the host *is* the device), so the round checks
  its results on the host, in the worker, and errors surface at ``wait()``.
* **CUDA** (NCCL): there is no worker thread. ``submit`` *issues* the whole
  round from the calling thread (the training loop's, or the autograd engine's
  while ``backward()`` blocks the training loop) onto a second, high-priority
  stream, and returns once it is queued; the overlap is the GPU's, between the
  two streams. The streams are ordered by CUDA events only, and the round
  issues no host synchronisation (``rounds.py`` decides skips on the device),
  so ``submit``, ``done`` and ``wait`` never block the host.

Why one thread on CUDA (NCCL's rule). NCCL documents that issuing operations
on several communicators of one device from several threads concurrently is
unsafe, and that every rank must issue its operations on different
communicators in the same order, or the ranks can deadlock (reliably with
``CUDA_DEVICE_MAX_CONNECTIONS=1``, and under SM pressure). On this path every
NCCL call, the round's and the user's own (a logged all-reduce,
``finish()``'s, a checkpoint's), is issued by the one thread that runs the
training loop, in program order, which is the same on every rank: a round's
collectives come exactly at the hand-off, i.e. in the ``backward()`` that
completes half an update or in ``step()``. This is how FSDP2 and Megatron
overlap: one issuing thread, a side stream, events.

Stream hand-offs on the CUDA path (each is commented where it is made):

1. ``submit``: an event recorded on the *parameters' device's* current
   (compute) stream after the gradients were copied into the round's buffer
   and the previous round's weights were installed; the side stream waits for
   it before the round's first kernel.
2. ``wait``: the compute stream waits for the round's end event (recorded on
   the side stream after its last kernel) before anything reads the weights
   the round all-gathered.
3. Memory: every tensor the round uses that was allocated on the compute
   stream is ``record_stream``-ed on the side stream, so the caching allocator
   never hands its memory to other work while the round may still use it, even
   if the optimizer is dropped without ``finish()``.
4. ``close``: the host waits for the last round's end event before returning,
   so its communicator may be destroyed (``finish()``) without cutting a
   collective short.

The scheduler also installs a finished round's weights into the model's
parameters (the theta / theta~ swap): it copies into the fixed parameter
storage, so parameter addresses never change.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from functools import partial
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

import torch

from . import device_api
from .stats import CudaTiming, HostTiming

__all__ = ["StreamScheduler"]

T = TypeVar("T")

# The side stream's priority: higher than the compute stream's (as FSDP2's), so a
# round's kernels are scheduled first when both streams have work ready.
SIDE_STREAM_PRIORITY = -1

class _Worker:
    """One daemon thread running submitted callables in order.

    A daemon (unlike ``ThreadPoolExecutor``'s workers) so that a round stuck in
    a collective with a dead peer can never keep the interpreter from exiting.
    """

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="acco-round", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fut, fn))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # handed to the caller of wait()
                    fut.set_exception(exc)
            # Drop the round's references here, not at the next get(): a thread that
            # frees tensors while the interpreter exits aborts the process.
            del item, fut, fn

    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float) -> None:
        """Stop the thread and join it (at most ``timeout`` s: it may be stuck with a dead peer)."""
        self._queue.put(None)
        self._thread.join(timeout)


class _Issued:
    """The outcome of a round issued on the calling thread (CUDA path), shaped like a future."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._result: Any = None
        self._error: Optional[BaseException] = None
        try:
            self._result = fn()
        except BaseException as exc:  # handed to the caller of wait(), as the worker's future would
            self._error = exc

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._result


class StreamScheduler:
    """Runs one round at a time asynchronously on ``device``'s side channel.

    ``submit(fn, uses)`` starts ``fn`` after all work already issued on the
    compute side (the hand-off), ``done()`` asks without blocking whether it
    finished, ``wait()`` orders the compute side after it (CPU: blocks the
    calling thread; CUDA: makes the compute stream wait, no host sync) and
    returns ``fn``'s result, re-raising its exception. After ``wait()``,
    ``last_timing`` holds that round's :class:`~acco.stats.HostTiming` (CPU) or
    :class:`~acco.stats.CudaTiming` (events, read lazily).

    ``api`` is the stream API (:func:`acco.device_api.stream_api` by default:
    ``torch.cuda`` on CUDA, none on CPU); a test may pass a simulated one to
    run the CUDA path over CPU tensors.
    """

    def __init__(self, device: torch.device, api: Any = None) -> None:
        device = torch.device(device)
        self._api = api if api is not None else device_api.stream_api(device)
        self.uses_streams = self._api is not None
        if self.uses_streams and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", self._api.current_device())  # fixed now: "cuda" means this device
        self.device = device
        self._pending: Any = None
        self._timing: Any = None
        self._last_end: Any = None  # end event of the last round issued (CUDA path)
        self.last_timing: Any = None
        self._worker: Optional[_Worker] = None
        if self.uses_streams:
            self._stream = self._api.Stream(self.device, priority=SIDE_STREAM_PRIORITY)
        else:
            self._worker = _Worker()
        self._closed = False
        self.host_waits = 0  # host_wait() calls that found the device not done yet (CUDA path)

    @property
    def in_flight(self) -> bool:
        """True from ``submit`` until ``wait`` has collected the round."""
        return self._pending is not None

    @property
    def side_stream(self) -> Any:
        """The stream rounds run on (CUDA path), else ``None``."""
        return self._stream if self.uses_streams else None

    def host_empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor the device may write without blocking (CUDA: pinned; CPU: plain)."""
        if self.uses_streams:
            return self._api.host_empty(shape, dtype)
        return torch.empty(shape, dtype=dtype)

    @property
    def last_end_event(self) -> Any:
        """The end event of the last round issued (CUDA path), else ``None``: complete once its work is."""
        return self._last_end

    def submit(self, fn: Callable[[], T], uses: Iterable[torch.Tensor] = ()) -> None:
        """Start ``fn`` after the compute side's work so far. ``uses``: tensors the round reads or writes
        that were allocated outside it (CUDA path: kept from reuse until the round is over)."""
        if self._closed:
            raise RuntimeError("StreamScheduler.submit() after close()")
        if self._pending is not None:
            raise RuntimeError("StreamScheduler runs one round at a time: wait() for the previous one first")
        if not self.uses_streams:
            timing = HostTiming(submit=HostTiming.now())
            self._timing = timing
            self._pending = self._worker.submit(partial(self._timed, fn, timing))
            return
        api, side = self._api, self._stream
        compute = api.current_stream(self.device)  # the parameters' device's, not the current device's
        timing = CudaTiming(submit=api.Event(), start=api.Event(), end=api.Event())
        # Hand-off 1. Compute stream: the gradients are in the round's buffer and the previous round's
        # weights are installed (both queued before this point); the side stream starts after them.
        timing.submit.record(compute)
        side.wait_event(timing.submit)
        for tensor in uses:
            # Hand-off 3. Allocator: memory the side stream uses is not reused before the side stream
            # has finished the work queued when it is freed (even if the optimizer is dropped mid-round).
            api.record_stream(tensor, side)
        with api.stream(side), torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            # The round's kernels and collectives go to the side stream (and its device); it may be issued
            # from inside the user's autocast region or backward, whose thread-local modes must not apply.
            timing.start.record(side)  # side stream: the round begins (for round_s only)
            issued = _Issued(fn)  # issues the round from this thread and returns: no host sync inside
            timing.end.record(side)  # side stream: the round's weights are in its output buffer
        self._last_end = timing.end
        self._timing = timing
        self._pending = issued

    @staticmethod
    def _timed(fn: Callable[[], T], timing: HostTiming) -> T:
        """Worker thread, CPU: run the round between two clock reads."""
        timing.start = HostTiming.now()
        try:
            return fn()
        finally:
            timing.end = HostTiming.now()

    def done(self) -> bool:
        """Whether the in-flight round has finished (True when none is). Never blocks."""
        if self._pending is None:
            return True
        if self.uses_streams:
            return self._timing.end.query()  # the side stream has run the round
        return self._pending.done()  # the worker has run the round

    def wait(self):
        """Order the compute side after the in-flight round; return its result."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        timing, self._timing = self._timing, None
        if self.uses_streams:
            compute = self._api.current_stream(self.device)
            timing.wait_begin = self._api.Event()
            timing.wait_begin.record(compute)  # compute stream: what it had to do before needing the round
            # Hand-off 2. Compute stream waits for the round's end: the weights it all-gathered are
            # read (installed into the parameters) only after this point. The host does not wait.
            compute.wait_event(timing.end)
            timing.wait_end = self._api.Event()
            timing.wait_end.record(compute)  # compute stream: resumes after the round (for wait_s only)
            self.last_timing = timing
            return pending.result()  # an error raised while issuing the round
        timing.wait_begin = HostTiming.now()
        try:
            result = pending.result()  # blocks until the worker has run the round; re-raises
        except BaseException:
            if not pending.done():  # the wait itself was interrupted (Ctrl-C): the round is still in flight
                self._pending, self._timing = pending, timing
            raise
        finally:
            timing.wait_end = HostTiming.now()
        self.last_timing = timing
        return result

    def mark(self) -> Any:
        """CUDA path: an event recorded now on the compute stream (complete once the work issued so far on
        it is), for reading what that work wrote into host memory; ``None`` on CPU."""
        if not self.uses_streams:
            return None
        event = self._api.Event()
        event.record(self._api.current_stream(self.device))  # compute stream: after the work issued so far
        return event

    def stamp(self) -> Any:
        """A point in the compute side's time: CPU, the host clock; CUDA, an event recorded now on the compute
        stream (the work issued so far). :meth:`seconds_between` reads two."""
        if not self.uses_streams:
            return HostTiming.now()
        event = self._api.Event()
        event.record(self._api.current_stream(self.device))  # compute stream: after the work issued so far
        return event

    def seconds_between(self, start: Any, end: Any) -> float:
        """Seconds from stamp ``start`` to stamp ``end``. CUDA: the host waits for ``end`` (a rare read: once
        per run for ``compression="auto"``)."""
        if not self.uses_streams:
            return end - start
        self.host_wait(end)  # host waits for the compute stream to pass the later stamp
        return start.elapsed_time(end) / 1e3

    def host_wait(self, event: Any) -> None:
        """Block the host until ``event`` (of a round issued earlier) has completed; count it in
        ``host_waits`` when it had not (a host running ahead of the device). CPU: nothing to wait for."""
        if not self.uses_streams:
            return
        if not event.query():
            self.host_waits += 1
            event.synchronize()  # host waits for the device: the only blocking point of the steady state

    def synchronize(self) -> None:
        """Block the host until the last round issued has finished on the device (CPU: already true
        after ``wait``). For the rare places that must: ``finish()``, checkpoints, errors."""
        if self.uses_streams and self._last_end is not None:
            self._last_end.synchronize()

    def settle(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s for the rounds handed off so far to end; return whether they did. Never
        raises. CPU: the worker has run them. CUDA: the last round's end event has completed on the device
        (polled, so that a round whose peers never issue it cannot hold the host forever)."""
        deadline = time.monotonic() + timeout
        if self.uses_streams:
            end = self._last_end
            while end is not None and not end.query():
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.001)  # host polls the side stream's last end event (no stream is made to wait)
            return True
        if self._pending is not None:
            concurrent.futures.wait([self._pending], timeout=max(0.0, deadline - time.monotonic()))
            return self._pending.done()
        return True

    def install(self, params: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        """Copy a finished round's weights into the parameters, in place (the theta/theta~ swap).

        Call after :meth:`wait`, on the compute side, before the next ``submit``
        overwrites ``sources``.
        """
        with torch.no_grad():
            torch._foreach_copy_(list(params), list(sources))

    def worker_alive(self) -> bool:
        """Whether the worker thread (CPU path) still runs, e.g. stuck in a collective with a dead peer."""
        return self._worker is not None and self._worker.alive()

    def close(self, wait: bool = True, join_timeout: float = 10.0) -> None:
        """Stop accepting rounds; with ``wait``, collect the in-flight one first and (CUDA) let the host
        wait until it has finished on the device; join the worker for at most ``join_timeout`` seconds."""
        if self._closed:
            return
        try:
            if wait:
                self.wait()
                # Hand-off 4. Host waits for the last round's end event: only then may the round's
                # communicator be destroyed without cutting its last all-gather short.
                self.synchronize()
        finally:
            self._closed = True
            if self._worker is not None:
                self._worker.shutdown(timeout=join_timeout)
