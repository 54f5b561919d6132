"""The stream and event API the scheduler drives: ``torch.cuda``, or a stand-in.

:func:`stream_api` returns the object the :class:`~acco.scheduler.StreamScheduler`
calls for streams and events on ``device``, or ``None`` where there are none
(CPU). Nothing else in the library touches ``torch.cuda`` streams, so a test can
substitute a simulated device (``tests/fake_cuda.py``) and run the CUDA code
path itself over CPU tensors.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["CudaStreams", "stream_api"]


class CudaStreams:
    """``torch.cuda``'s streams and events, under the names the scheduler uses."""

    Stream = staticmethod(lambda device, priority=0: torch.cuda.Stream(device=device, priority=priority))
    Event = staticmethod(lambda: torch.cuda.Event(enable_timing=True))
    stream = staticmethod(torch.cuda.stream)
    current_stream = staticmethod(torch.cuda.current_stream)
    current_device = staticmethod(torch.cuda.current_device)

    @staticmethod
    def host_empty(shape: Any, dtype: torch.dtype) -> torch.Tensor:
        """A page-locked host tensor: a device-to-host copy into it can be issued without blocking."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    @staticmethod
    def record_stream(tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor``: its memory is not reused until
        the work ``stream`` has queued when the tensor is freed has finished. Host tensors (Adafactor's
        step counter, an ``lr`` tensor on the CPU) are not the device allocator's, and torch has no
        ``record_stream`` for them: they are left alone."""
        if tensor.is_cuda:
            tensor.record_stream(stream)


def stream_api(device: torch.device) -> Optional[Any]:
    """The stream API for ``device``: :class:`CudaStreams` on CUDA, ``None`` (no streams) elsewhere."""
    return CudaStreams() if torch.device(device).type == "cuda" else None


_real_stream_api = stream_api  # what a test that substitutes ``stream_api`` puts back
