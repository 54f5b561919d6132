"""StreamScheduler: where a communication round runs.

* CPU (gloo, or no process group): on one background worker thread. gloo's
  collectives and PyTorch's kernels release the GIL, so a round really runs
  while the main thread computes the next backward.
* CUDA (NCCL): the same worker thread issues the round's kernels and
  collectives on a second CUDA stream, ordered with the compute stream by CUDA
  events only; the training loop's thread never blocks on the device here.

The scheduler also installs a finished round's weights into the model's
parameters (the theta / theta~ swap): it copies into the fixed parameter
storage, so parameter addresses never change.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from functools import partial
from typing import Callable, Optional, Sequence, TypeVar

import torch

from .stats import CudaTiming, HostTiming

__all__ = ["StreamScheduler"]

T = TypeVar("T")


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


class StreamScheduler:
    """Runs one round at a time asynchronously on ``device``'s side channel.

    ``submit(fn)`` starts ``fn`` after all work already issued on the compute
    side (the hand-off), ``done()`` asks without blocking whether it finished,
    ``wait()`` orders the compute side after it (CPU: blocks the calling
    thread; CUDA: makes the current stream wait, no host sync) and returns
    ``fn``'s result, re-raising its exception. After ``wait()``,
    ``last_timing`` holds that round's :class:`~acco.stats.HostTiming` (CPU) or
    :class:`~acco.stats.CudaTiming` (CUDA events, read lazily).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._pending: Optional[concurrent.futures.Future] = None
        self._timing = None
        self.last_timing = None
        if self._cuda:
            self._stream = torch.cuda.Stream(device=self.device)
        self._worker = _Worker()
        self._closed = False

    @property
    def in_flight(self) -> bool:
        """True from ``submit`` until ``wait`` has collected the round."""
        return self._pending is not None

    def submit(self, fn: Callable[[], T]) -> None:
        if self._closed:
            raise RuntimeError("StreamScheduler.submit() after close()")
        if self._pending is not None:
            raise RuntimeError("StreamScheduler runs one round at a time: wait() for the previous one first")
        if self._cuda:
            timing = CudaTiming(submit=torch.cuda.Event(enable_timing=True), end=torch.cuda.Event(enable_timing=True))
            timing.submit.record()  # compute stream: the gradient hand-off and the parameter copy are issued
            fn = partial(self._on_side_stream, fn, timing)
        else:
            timing = HostTiming(submit=HostTiming.now())
            fn = partial(self._timed, fn, timing)
        self._timing = timing
        self._pending = self._worker.submit(fn)

    @staticmethod
    def _timed(fn: Callable[[], T], timing: HostTiming) -> T:
        """Worker thread, CPU: run the round between two clock reads."""
        timing.start = HostTiming.now()
        try:
            return fn()
        finally:
            timing.end = HostTiming.now()

    def _on_side_stream(self, fn: Callable[[], T], timing: CudaTiming) -> T:
        """Worker thread, CUDA: issue the round on the side stream between two events."""
        torch.cuda.set_device(self.device)
        self._stream.wait_event(timing.submit)  # side stream: start only after the hand-off on the compute stream
        timing.start = torch.cuda.Event(enable_timing=True)
        timing.start.record(self._stream)  # side stream: the round begins (for round_s only)
        with torch.cuda.stream(self._stream):
            result = fn()
        timing.end.record(self._stream)  # side stream: the round's weights are in the comm buffer
        return result

    def done(self) -> bool:
        """Whether the in-flight round has finished (True when none is). Never blocks."""
        if self._pending is None:
            return True
        if not self._pending.done():  # the worker is still issuing (CUDA) or running (CPU) the round
            return False
        return not self._cuda or self._timing.end.query()

    def wait(self):
        """Order the compute side after the in-flight round; return its result."""
        if self._pending is None:
            return None
        fut, self._pending = self._pending, None
        timing, self._timing = self._timing, None
        if self._cuda:
            result = fut.result()  # blocks until the worker has issued the round (not run it); re-raises
            stream = torch.cuda.current_stream(self.device)
            timing.wait_begin = torch.cuda.Event(enable_timing=True)
            timing.wait_begin.record(stream)  # compute stream: what it had to do before needing the round
            stream.wait_event(timing.end)  # compute waits for the round's weights
            timing.wait_end = torch.cuda.Event(enable_timing=True)
            timing.wait_end.record(stream)  # compute stream: resumes after the round (for wait_s only)
        else:
            timing.wait_begin = HostTiming.now()
            try:
                result = fut.result()  # blocks until the worker has run the round; re-raises
            finally:
                timing.wait_end = HostTiming.now()
        self.last_timing = timing
        return result

    def install(self, params: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        """Copy a finished round's weights into the parameters, in place (the theta/theta~ swap).

        Call after :meth:`wait`, on the compute side, before the next ``submit``
        overwrites ``sources``.
        """
        with torch.no_grad():
            torch._foreach_copy_(list(params), list(sources))

    def worker_alive(self) -> bool:
        """Whether the worker thread still runs (e.g. stuck in a collective with a dead peer)."""
        return self._worker.alive()

    def close(self, wait: bool = True, join_timeout: float = 10.0) -> None:
        """Stop accepting rounds; with ``wait``, collect the in-flight one first; join the worker
        for at most ``join_timeout`` seconds."""
        if self._closed:
            return
        try:
            if wait:
                self.wait()
        finally:
            self._closed = True
            self._worker.shutdown(timeout=join_timeout)
