"""Named streams and keyed events for the partitioned-overlap schedule (paper 5.2).

Computation runs on the ``"compute"`` stream and communication on the ``"comm"`` stream;
events order them: a collective launched at its slot waits on the event the compute stream
recorded after that slot, and its result's first user waits on the event the comm stream
recorded after the collective. Events are keyed by a partition id (int) or a collective's node
name (str) and are reused every iteration (recording again overwrites).

:class:`CudaStreamTable` uses real ``torch.cuda.Stream`` / ``torch.cuda.Event`` objects; the
compute stream is the stream current when the table is made (where autograd and the rest of
the step run). :class:`NullStreamTable` has the same interface and does nothing (CPU, where
every op runs in program order anyway). Both check the same misuse: an unknown stream name, and
waiting on an event that was never recorded (on CUDA such a wait returns at once, a silent race).
Tensors that cross streams must also be kept alive for the consumer stream
(``Tensor.record_stream``); that is the caller's job.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from typing import Literal

import torch

from kareus_fx.errors import KareusError

StreamName = Literal["compute", "comm"]
STREAM_NAMES: tuple[StreamName, ...] = ("compute", "comm")
EventKey = int | str


class StreamTableError(KareusError, ValueError):
    """A stream or event used in a way the schedule cannot mean (unknown name, wait before record)."""


class StreamTable(abc.ABC):
    """Streams by name and events by key; subclasses do the device work."""

    def __init__(self) -> None:
        self._recorded: set[EventKey] = set()

    @contextlib.contextmanager
    def use(self, stream: StreamName) -> Iterator[None]:
        """Run the body's ops on ``stream``."""
        _check_stream(stream)
        with self._stream_context(stream):
            yield

    def record(self, key: EventKey, stream: StreamName) -> None:
        """Record event ``key`` on ``stream`` (after the work issued to it so far)."""
        _check_stream(stream)
        _check_key(key)
        self._record(key, stream)
        self._recorded.add(key)

    def wait(self, key: EventKey, stream: StreamName) -> None:
        """Make ``stream``'s later work wait for event ``key``."""
        _check_stream(stream)
        _check_key(key)
        if key not in self._recorded:
            raise StreamTableError(
                f"stream {stream!r} waits on event {key!r}, which was never recorded: record it "
                "on the producing stream first (a schedule out of order)"
            )
        self._wait(key, stream)

    @abc.abstractmethod
    def _stream_context(self, stream: StreamName) -> contextlib.AbstractContextManager[None]:
        """A context manager that makes ``stream`` current."""

    @abc.abstractmethod
    def _record(self, key: EventKey, stream: StreamName) -> None:
        """Record the device event for ``key`` on ``stream``."""

    @abc.abstractmethod
    def _wait(self, key: EventKey, stream: StreamName) -> None:
        """Make ``stream`` wait on the device event for ``key``."""


class NullStreamTable(StreamTable):
    """The CPU table: ops run in program order, so streams and events do nothing."""

    def _stream_context(self, stream: StreamName) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def _record(self, key: EventKey, stream: StreamName) -> None:
        pass

    def _wait(self, key: EventKey, stream: StreamName) -> None:
        pass


class CudaStreamTable(StreamTable):
    """Real CUDA streams and events on one device."""

    def __init__(self, device: torch.device | int | None = None) -> None:
        super().__init__()
        device = _current_cuda_device() if device is None else torch.device(device)
        if device.type != "cuda":
            raise StreamTableError(f"CudaStreamTable needs a CUDA device, got {device}")
        self.device = device
        self.streams: dict[StreamName, torch.cuda.Stream] = {
            "compute": torch.cuda.current_stream(device),
            "comm": torch.cuda.Stream(device=device),
        }
        self.events: dict[EventKey, torch.cuda.Event] = {}

    def _stream_context(self, stream: StreamName) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(self.streams[stream])

    def _record(self, key: EventKey, stream: StreamName) -> None:
        event = self.events.get(key)
        if event is None:
            event = self.events[key] = torch.cuda.Event()
        event.record(self.streams[stream])

    def _wait(self, key: EventKey, stream: StreamName) -> None:
        self.streams[stream].wait_event(self.events[key])


def make_stream_table(device: torch.device | str | None = None) -> StreamTable:
    """A CUDA table for a CUDA device (default: the current one if CUDA is up), else the null one."""
    if device is None:
        device = _current_cuda_device() if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise StreamTableError(f"device {device} asked for, but CUDA is not available here")
        return CudaStreamTable(device)
    return NullStreamTable()


def _current_cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _check_stream(stream: str) -> None:
    if stream not in STREAM_NAMES:
        raise StreamTableError(f"unknown stream {stream!r}; the streams are {', '.join(STREAM_NAMES)}")


def _check_key(key: object) -> None:
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise StreamTableError(f"event keys are a partition id (int) or a collective node name (str), got {key!r}")
