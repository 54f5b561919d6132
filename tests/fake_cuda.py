"""A simulated CUDA device over CPU tensors: streams, events, deferred execution, and a race checker.

``FakeCuda`` stands in for ``torch.cuda`` behind :mod:`acco.device_api`, so the
library's CUDA code path itself runs in CI, on CPU tensors, with gloo carrying
the collectives:

* **Streams run adversarially.** The compute streams (each device's default
  stream) run every op at once. A side stream runs *nothing* until it is
  forced: another stream waits for one of its events, or the host
  synchronises with it. Its ops are queued; their outputs are NaN-filled
  placeholders until they run. So a missing ``wait_event`` on the compute side
  shows as wrong numbers, not as luck.
* **A race checker** in the spirit of ``torch.cuda._sanitizer``: a
  ``TorchDispatchMode`` sees every op (collectives included), records which
  stream reads and writes each storage, and keeps a vector clock per stream
  (an op is ordered after another stream's op only through an event it waited
  for, or a host synchronisation). Any access not ordered after the other
  stream's last conflicting access is a race.
* **Host synchronisations** (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``,
  ``.numpy()``, ``torch.equal``, data-dependent shapes (``nonzero``, ...) of device
  memory, ``Event``/``Stream.synchronize``) are recorded; a test forbids them
  where the library must not block (``forbid_syncs``).
* **Host memory.** ``host_empty`` tensors are pinned host memory; tensors made
  from Python data (``torch.tensor(...)``, and the 0-dim tensor torch builds for
  a Python scalar assigned into a tensor, ``t[i] = 2.0``) are *pageable* host
  memory, as on CUDA (``THPVariable_setitem`` builds the value on the CPU). A
  copy from pageable memory into device memory is a blocking host sync
  (``memcpy_and_sync``), and so is a copy between pinned and device memory
  without ``non_blocking=True``.
* **Completion at random moments** (``completion_seed``): a side stream's work,
  once run, becomes visible to ``query()`` only after a random number of further
  queries, drawn per event from the seed, so ranks given different seeds
  disagree on what is done, as real GPUs do.
* ``synchronize()`` of an event or stream whose work has already run returns
  at once (as ``cudaEventSynchronize`` does) and is not counted as a sync.
* Every collective is logged with its process group (``collectives``).
* ``record_stream`` calls are recorded: a storage the side stream uses that
  was allocated by another stream and never recorded on it is a use-after-free
  hazard (``unrecorded_side_storages``).

Tensors are CPU tensors. "Device" ``cpu`` means the fake device
``model_device`` (where the test's model lives), so a test can put the model on
fake device 1 while the current device is 0.
"""

from __future__ import annotations

import contextlib
import random
import traceback
import weakref
from collections import deque
from typing import Any, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

_LAYER: Optional["FakeCuda"] = None

_HOST_READS = {torch.ops.aten._local_scalar_dense.default}
# Tensor methods that read values on the host without going through the dispatcher on CPU tensors.
_HOST_METHODS = ("tolist", "numpy", "cpu")
# Ops whose result (a Python value, or a shape) depends on the values: the host must wait for them.
_DATA_DEPENDENT = {"equal", "nonzero", "masked_select", "is_nonzero", "unique", "_unique", "_unique2",
                   "unique_consecutive", "unique_dim", "argwhere", "nonzero_static", "repeat_interleave"}
# c10d ops' schemas carry no alias information: (written args, read args) by argument name.
_C10D = {
    "allreduce_": (("tensors",), ("tensors",)),
    "broadcast_": (("tensors",), ("tensors",)),
    "_allgather_base_": (("output_tensor",), ("input_tensor",)),
    "_reduce_scatter_base_": (("output_tensor",), ("input_tensor",)),
    "allgather_": (("output_tensors",), ("input_tensors",)),
    "allgather_into_tensor_coalesced_": (("outputs",), ("inputs",)),
    "reduce_scatter_tensor_coalesced_": (("outputs",), ("inputs",)),
    "allreduce_coalesced_": (("tensors",), ("tensors",)),
    "alltoall_base_": (("output",), ("input",)),  # compressed rounds' gradient exchange
}


def _tensors(x: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _merge(into: Dict[str, int], clock: Dict[str, int]) -> None:
    """Vector clocks: ``into`` now also knows everything ``clock`` knows."""
    for name, n in clock.items():
        if into.get(name, 0) < n:
            into[name] = n


def _key(t: torch.Tensor) -> Optional[int]:
    if t.device.type != "cpu" or t.layout != torch.strided:
        return None
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


class FakeStream:
    def __init__(self, layer: "FakeCuda", device: int, name: str, eager: bool, priority: int = 0) -> None:
        self.layer, self.device, self.name, self.eager, self.priority = layer, device, name, eager, priority
        self.issued = 0  # ops issued on this stream
        self.done = 0  # ops executed
        self.queue: "deque[tuple]" = deque()  # deferred entries: (op number they precede or are, thunk)
        self.clock: Dict[str, int] = {}  # other streams' ops this stream's next op is ordered after

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"

    def wait_event(self, event: "FakeEvent") -> None:
        self.layer._wait(self, event)

    def wait_stream(self, other: "FakeStream") -> None:
        ev = FakeEvent()
        ev.record(other)
        self.wait_event(ev)

    def record_event(self, event: Optional["FakeEvent"] = None) -> "FakeEvent":
        event = event or FakeEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        if self.done >= self.issued and self.layer._visible(self, self.issued):
            self.layer._host_learns(self._clock_now())
            return True
        return False

    def synchronize(self) -> None:
        self.layer._host_sync(self, self.issued, "Stream.synchronize")

    def _clock_now(self) -> Dict[str, int]:
        c = dict(self.clock)
        c[self.name] = self.issued
        return c


class FakeEvent:
    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self.stream: Optional[FakeStream] = None
        self.seq = 0
        self.clock: Dict[str, int] = {}

    def record(self, stream: Optional[FakeStream] = None) -> None:
        layer = _LAYER
        stream = stream if stream is not None else layer.current_stream()  # the *current device's* stream
        self.stream, self.seq, self.clock = stream, stream.issued, stream._clock_now()
        layer.events_recorded += 1

    def query(self) -> bool:
        if self.stream is None or (self.stream.done >= self.seq and _LAYER._visible(self.stream, self.seq)):
            _LAYER._host_learns(self.clock)
            return True
        return False  # adversarial: a side stream never runs on its own

    def synchronize(self) -> None:
        if self.stream is not None:
            _LAYER._host_sync(self.stream, self.seq, "Event.synchronize", self.clock)

    def elapsed_time(self, other: "FakeEvent") -> float:
        if self.stream is None or other.stream is None:  # as CUDA: both events must have been recorded
            raise RuntimeError("elapsed_time() of an event that was never recorded")
        if not (self.query() and other.query()):
            raise RuntimeError("elapsed_time() of an event that has not completed")
        return 0.0


class _StreamContext:
    def __init__(self, layer: "FakeCuda", stream: Optional[FakeStream]) -> None:
        self.layer, self.stream = layer, stream

    def __enter__(self) -> None:
        if self.stream is None:
            return
        self.saved = (self.layer._current_device, dict(self.layer._current))
        self.layer._current_device = self.stream.device
        self.layer._current[self.stream.device] = self.stream

    def __exit__(self, *exc: Any) -> None:
        if self.stream is not None:
            self.layer._current_device, self.layer._current = self.saved[0], self.saved[1]


class FakeCuda(TorchDispatchMode):
    """The simulated device. Use as a context manager around everything the test runs on it."""

    def __init__(self, devices: int = 2, model_device: int = 0, current_device: int = 0,
                 completion_seed: Optional[int] = None) -> None:
        super().__init__()
        # (stream name, op number) -> queries still answered "not done" after the work has run
        self._rng = random.Random(completion_seed) if completion_seed is not None else None
        self._late: Dict[tuple, int] = {}
        self.pageable: set = set()  # storages of host memory made from Python data (torch.tensor, a Python scalar)
        self.collectives: List[tuple] = []  # (op name, process group) of every collective issued
        self.side_peak_bytes = 0  # the most memory side streams' ops had allocated and still alive at once
        self.model_device = model_device
        self._current_device = current_device
        self._defaults = {d: FakeStream(self, d, f"cuda:{d}/default", eager=True) for d in range(devices)}
        self._current: Dict[int, FakeStream] = dict(self._defaults)
        self.side_streams: List[FakeStream] = []
        self.host_clock: Dict[str, int] = {}
        self.last_write: Dict[int, tuple] = {}  # storage -> (stream name, op number)
        self.reads: Dict[int, Dict[str, int]] = {}  # storage -> {stream name: op number} since the last write
        self.owner: Dict[int, str] = {}  # storage -> stream that allocated it
        self.shapes: Dict[int, tuple] = {}  # storage -> (shape, dtype) of the tensor allocated with it
        self.owner_ref: Dict[int, Any] = {}  # storage -> weak reference to the tensor allocated with it
        self.host_storages: set = set()  # storages of host_empty tensors (pinned host memory)
        self.recorded: Dict[int, set] = {}  # storage -> streams it was record_stream-ed on
        self.side_touched: Dict[int, str] = {}  # storage -> the side stream that used it
        self.side_ops: Dict[int, tuple] = {}  # storage -> (op, shape) of a side stream read
        self.unrecorded: List[str] = []  # judged when their memory was allocated anew
        self.races: List[str] = []
        self.syncs: List[str] = []  # host synchronisations (all)
        self.forbidden_syncs: List[str] = []  # those inside forbid_syncs()
        self._forbid = 0
        self.events_recorded = 0
        self.deferred_ops = 0

    # ------------------------------------------------------------ torch.cuda API

    def Stream(self, device: Any = None, priority: int = 0) -> FakeStream:
        d = self._index(device)
        s = FakeStream(self, d, f"cuda:{d}/side{len(self.side_streams)}", eager=False, priority=priority)
        self.side_streams.append(s)
        return s

    def Event(self, enable_timing: bool = False) -> FakeEvent:
        return FakeEvent()

    def stream(self, stream: Optional[FakeStream]) -> _StreamContext:
        return _StreamContext(self, stream)

    def current_stream(self, device: Any = None) -> FakeStream:
        return self._current[self._index(device)]

    def current_device(self) -> int:
        return self._current_device

    def set_device(self, device: Any) -> None:
        self._current_device = self._index(device)

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        k = _key(tensor)
        if k is not None:
            self.recorded.setdefault(k, set()).add(stream.name)

    def host_empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        with _disable_current_modes():
            t = torch.empty(shape, dtype=dtype)
        k = _key(t)
        self._retire(k)
        self.last_write.pop(k, None)
        self.reads.pop(k, None)
        self.pageable.discard(k)
        self.host_storages.add(k)
        self.owner[k] = "host"
        return t

    def synchronize(self) -> None:
        """Like ``torch.cuda.synchronize()``: run everything, the host waits for all streams."""
        for s in self.side_streams:
            self._host_sync(s, s.issued, "synchronize")

    def _index(self, device: Any) -> int:
        if device is None:
            return self._current_device
        if isinstance(device, int):
            return device
        device = torch.device(device)
        if device.type == "cpu":
            return self.model_device
        return device.index if device.index is not None else self._current_device

    # ------------------------------------------------------------ context

    def __enter__(self) -> "FakeCuda":
        global _LAYER
        assert _LAYER is None, "one FakeCuda at a time"
        _LAYER = self
        layer = self
        self._patched = {name: getattr(torch.Tensor, name) for name in _HOST_METHODS}

        def host_method(name: str):
            real = self._patched[name]

            def method(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # not dispatched on CPU: a host read
                layer._host_read(t, name)
                return real(t, *args, **kwargs)

            return method

        for name in _HOST_METHODS:
            setattr(torch.Tensor, name, host_method(name))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        global _LAYER
        try:
            super().__exit__(*exc)
        finally:
            for name, real in self._patched.items():
                setattr(torch.Tensor, name, real)
            _LAYER = None

    @contextlib.contextmanager
    def forbid_syncs(self):
        self._forbid += 1
        try:
            yield
        finally:
            self._forbid -= 1

    def _known(self, k: int) -> bool:
        """Whether the memory at ``k`` was allocated by an op this device saw and its tensor is still alive
        (Python numbers become 0-dim CPU tensors behind the dispatcher's back, at addresses freed earlier)."""
        ref = self.owner_ref.get(k)
        return ref is not None and ref() is not None

    def _unrecorded(self, k: int) -> Optional[str]:
        side = self.side_touched.get(k)
        if side is None:
            return None
        owner = self.owner.get(k, "unknown (allocated before the fake device)")
        if owner not in (side, "host") and side not in self.recorded.get(k, ()):
            return f"storage {k:#x} {self.shapes.get(k)} allocated by {owner}, used by {side} in {self.side_ops.get(k)}"
        return None

    def _retire(self, k: int) -> None:
        """The memory at ``k`` is allocated anew: judge its previous life, then forget it."""
        problem = self._unrecorded(k)
        if problem is not None:
            self.unrecorded.append(problem)
        self.side_touched.pop(k, None)
        self.recorded.pop(k, None)

    def side_live_bytes(self) -> int:
        """Bytes of the tensors allocated by side-stream ops that are still alive."""
        live = 0
        for k, ref in self.owner_ref.items():
            t = ref()
            if t is not None and self.owner.get(k, "").find("/side") >= 0:
                live += t.untyped_storage().nbytes()
        return live

    def unrecorded_side_storages(self) -> List[str]:
        """Storages a side stream used, allocated by another stream, never record_stream-ed on it."""
        return self.unrecorded + [p for p in map(self._unrecorded, list(self.side_touched)) if p is not None]

    # ------------------------------------------------------------ ordering and execution

    def _op_stream(self) -> FakeStream:
        """Ops on the model's tensors run on the model device's current stream (as CUDA kernels do)."""
        return self._current[self.model_device]

    def _wait(self, stream: FakeStream, event: FakeEvent) -> None:
        if event.stream is None:
            return
        _merge(stream.clock, event.clock)
        if event.stream is stream:
            return
        src, seq = event.stream, event.seq
        if stream.eager:
            self._flush(src, seq)  # this stream's next op runs now: what it waits for must have run
        else:
            stream.queue.append((stream.issued + 1, lambda: self._flush(src, seq)))

    def _flush(self, stream: FakeStream, upto: int) -> None:
        with _disable_current_modes():
            while stream.queue and stream.queue[0][0] <= upto:
                _, thunk = stream.queue.popleft()
                thunk()
        stream.done = max(stream.done, upto)

    def _host_learns(self, clock: Dict[str, int]) -> None:
        _merge(self.host_clock, clock)

    def _visible(self, stream: FakeStream, seq: int) -> bool:
        """Whether work that has run is seen as complete yet (``completion_seed``: after a random number of
        queries, drawn once per event, so two ranks see the same round complete at different moments)."""
        if self._rng is None or stream.eager:
            return True
        key = (stream.name, seq)
        if key not in self._late:
            self._late[key] = self._rng.choice((0, 0, 1, 2, 3, 5))
        if self._late[key] > 0:
            self._late[key] -= 1
            return False
        return True

    def _host_sync(self, stream: FakeStream, upto: int, what: str, clock: Optional[Dict[str, int]] = None) -> None:
        ran = stream.done >= upto
        self._late[(stream.name, upto)] = 0  # the host waited: it is complete now, whatever query() said
        self._flush(stream, upto)
        if ran and what in ("Event.synchronize", "Stream.synchronize"):
            self._host_learns(clock if clock is not None else stream._clock_now())
            return  # the work had run: cudaEventSynchronize returns at once, nothing blocks
        self._host_learns(clock if clock is not None else stream._clock_now())
        if stream.eager and what == "host read":
            return  # reading a value the eager stream already computed: still a sync on real CUDA, recorded below
        self._note_sync(f"{what} on {stream.name}")

    def _note_sync(self, what: str) -> None:
        where = "".join(traceback.format_stack(limit=8)[:-3])
        self.syncs.append(what)
        if self._forbid:
            self.forbidden_syncs.append(f"{what}\n{where}")

    def _check_copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        """Copies between host and device memory that block the host on CUDA."""
        kd, ks = _key(dst), _key(src)
        host = self.host_storages | self.pageable
        if ks in self.pageable and kd not in host:
            self._note_sync(f"copy of pageable host memory {tuple(src.shape)} into device memory (a Python scalar "
                            "assigned into a device tensor, or torch.tensor(...)): memcpy_and_sync")
        elif (ks in self.host_storages) != (kd in self.host_storages) and ks not in self.pageable and not non_blocking:
            self._note_sync(f"copy between pinned host memory and device memory {tuple(dst.shape)} without "
                            "non_blocking=True")

    def _host_read(self, t: torch.Tensor, what: str) -> None:
        k = _key(t)
        if k in self.host_storages:  # pinned host memory: a plain read, ordered only by what the host knows
            self._check("host", self.host_clock, [t], [], what)
            return
        stream = self._op_stream()  # a device-to-host copy on the current stream, then the host waits for it
        self._check(stream.name, self._issue_clock(stream), [t], [], what)
        self._flush(stream, stream.issued)
        self._host_learns(stream._clock_now())
        self._note_sync(f"{what} of device memory (syncs {stream.name})")

    def _issue_clock(self, stream: FakeStream) -> Dict[str, int]:
        _merge(stream.clock, self.host_clock)  # the host issues this op after what it waited for
        return stream.clock

    def _check(self, who: str, clock: Dict[str, int], reads, writes, what: Any) -> None:
        """Every access must come after the other streams' last write; a write also after their reads."""
        for verb, tensors in (("reads", reads), ("writes", writes)):
            for t in tensors:
                k = _key(t)
                if k is None:
                    continue
                w = self.last_write.get(k)
                if w is not None and w[0] != who and clock.get(w[0], 0) < w[1]:
                    self.races.append(f"{who} {verb} {tuple(t.shape)} ({what}) written by {w[0]} op {w[1]}, not waited for")
                if verb == "writes":
                    for r, rn in self.reads.get(k, {}).items():
                        if r != who and clock.get(r, 0) < rn:
                            self.races.append(f"{who} writes {tuple(t.shape)} ({what}) read by {r} op {rn}, not waited for")

    def _account(self, stream: FakeStream, reads, writes, outputs, what: Any = None) -> None:
        n = stream.issued
        for t in reads:
            k = _key(t)
            if k is not None:
                self.reads.setdefault(k, {})[stream.name] = n
                if not stream.eager and (t.dim() > 0 or self._known(k)):  # unknown 0-dim: a Python number
                    self.side_touched[k] = stream.name
                    self.side_ops[k] = (str(what), tuple(t.shape))
        for t in writes:
            k = _key(t)
            if k is not None:
                self.last_write[k] = (stream.name, n)
                self.reads[k] = {}
                if not stream.eager:
                    self.side_touched[k] = stream.name
        for t in outputs:  # fresh memory: its history starts here (a freed host_empty tensor's memory included)
            k = _key(t)
            if k is not None:
                self.host_storages.discard(k)
                self.pageable.discard(k)
                self._retire(k)
                self.last_write[k] = (stream.name, n)
                self.reads[k] = {}
                self.owner[k] = stream.name
                self.owner_ref[k] = weakref.ref(t)
                self.shapes[k] = (tuple(t.shape), t.dtype)
        if outputs and not stream.eager:
            self.side_peak_bytes = max(self.side_peak_bytes, self.side_live_bytes())

    # ------------------------------------------------------------ the dispatch mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stream = self._op_stream()
        if func in _HOST_READS:
            self._host_read(args[0], str(func))
            return func(*args, **kwargs)
        if func._opname in _DATA_DEPENDENT:
            for t in _tensors((args, kwargs)):
                self._host_read(t, str(func))
            return func(*args, **kwargs)
        schema = func._schema
        inputs = _tensors((args, kwargs))
        if func.namespace == "c10d":
            if func._opname not in _C10D:
                raise NotImplementedError(f"fake CUDA: collective {func} is not simulated (set ACCO_RING=0)")
            names = [a.name for a in schema.arguments]
            bound = dict(zip(names, args))
            bound.update(kwargs)
            self.collectives.append((func._opname, bound.get("process_group")))
            w_names, r_names = _C10D[func._opname]
            writes = _tensors([bound.get(n) for n in w_names])
            reads = _tensors([bound.get(n) for n in r_names])
        else:
            if func is torch.ops.aten.copy_.default:
                self._check_copy(args[0], args[1], bool(args[2] if len(args) > 2 else kwargs.get("non_blocking")))
            writes, reads = [], []
            for a, v in zip(schema.arguments, list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]):
                ts = _tensors(v)
                if a.alias_info is not None and a.alias_info.is_write:
                    writes += ts
                else:
                    reads += ts
            aliasing = any(r.alias_info is not None for r in schema.returns)
            if not writes and (aliasing or not inputs):  # views, and factories: no device work to order
                out = func(*args, **kwargs)
                if not inputs or func is torch.ops.aten.lift_fresh.default:  # new memory (lift_fresh: torch.tensor)
                    self._account(stream, [], [], _tensors(out))
                if func is torch.ops.aten.lift_fresh.default:  # Python data: pageable host memory on CUDA
                    self.pageable.update(_key(t) for t in _tensors(out))
                return out
        self._check(stream.name, self._issue_clock(stream), reads, writes, func)
        stream.issued += 1
        if stream.eager:
            out = func(*args, **kwargs)
            self._account(stream, reads, writes, [t for t in _tensors(out) if not any(t is w for w in writes)])
            stream.done = stream.issued
            return out
        return self._defer(stream, func, args, kwargs, reads, writes)

    def _defer(self, stream: FakeStream, func, args, kwargs, reads, writes):
        n = stream.issued
        self.deferred_ops += 1
        if func.namespace == "c10d":
            from torch._C._distributed_c10d import _create_work_from_future

            single = len(func._schema.returns) == 1  # alltoall_base_ returns its Work alone

            def run() -> None:
                result = func(*args, **kwargs)
                (result if single else result[-1]).wait()

            stream.queue.append((n, run))
            self._account(stream, reads, writes, [], func)
            fut = torch.futures.Future()
            fut.set_result(None)
            work = _create_work_from_future(fut).boxed()
            return work if single else (args[0], work)
        schema = func._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            stream.queue.append((n, lambda: func(*args, **kwargs)))
            self._account(stream, reads, writes, [], func)
            if not schema.returns:
                return None
            vals = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
            out = []
            for r in schema.returns:
                for a, v in zip(schema.arguments, vals):
                    if a.alias_info is not None and r.alias_info is not None and a.alias_info.before_set == r.alias_info.before_set:
                        out.append(v)
                        break
            return out[0] if len(out) == 1 else tuple(out)
        # A functional op: NaN placeholders now, the values when the stream runs it.
        try:
            meta = func(*tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, args),
                        **tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, kwargs))
        except Exception:
            meta = None
        leaves, spec = tree_flatten(meta)
        if meta is None or not all(isinstance(x, torch.Tensor) for x in leaves):
            self._flush(stream, n)  # cannot defer this one: run the stream up to it, then it
            out = func(*args, **kwargs)
            self._account(stream, reads, [], _tensors(out), func)
            return out

        def placeholder(m: torch.Tensor) -> torch.Tensor:
            t = torch.empty_strided(m.shape, m.stride(), dtype=m.dtype)
            if t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))
            return t

        holders = [placeholder(m) for m in leaves]

        def run() -> None:
            real = _tensors(func(*args, **kwargs))
            for h, r in zip(holders, real):
                h.copy_(r)

        stream.queue.append((n, run))
        self._account(stream, reads, writes, holders, func)
        return tree_unflatten(holders, spec)
