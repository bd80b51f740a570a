"""GPU waits (elasticrun.worker.gpu_waits): collectives on CUDA tensors timed with events.

No GPU exists here, so the CUDA events are a fake that keeps a stream's timeline: an
event records the stream's tail, and is done once the GPU has executed that far. What is
checked is the step timing's arithmetic on it: the host's time in a queued collective is
not the wait, the stream's time is, counted once the GPU has passed it; a DDP GPU bucket's
wait runs from the last bucket's launch to its all-reduce's end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from elasticrun.worker import steptime
from elasticrun.worker.ddp_waits import BucketWaits
from elasticrun.worker.gpu_waits import GpuWaits, on_cuda
from elasticrun.worker.steptime import Recorder, _timed


class Stream:
    """A CUDA stream's timeline, in milliseconds: what is queued, and how far the GPU got."""

    def __init__(self) -> None:
        self.queued = 0.0
        self.executed = 0.0

    def event(self) -> Event:
        return Event(self)


class Event:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.stream.queued

    def query(self) -> bool:
        assert self.at is not None
        return self.stream.executed >= self.at

    def elapsed_time(self, other: Event) -> float:
        assert self.at is not None and other.at is not None and self.query() and other.query()
        return other.at - self.at


class Tensor:
    def __init__(self, is_cuda: bool) -> None:
        self.is_cuda = is_cuda


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def timed_recorder(monkeypatch: pytest.MonkeyPatch) -> tuple[Recorder, Clock, Stream]:
    clock, stream = Clock(), Stream()
    recorder = Recorder("unused", clock)
    recorder.gpu = GpuWaits(stream.event)
    monkeypatch.setattr(steptime, "_recorder", recorder)
    return recorder, clock, stream


def collective(clock: Clock, stream: Stream, host_ms: float, gpu_ms: float) -> Callable[..., Any]:
    """A queued collective: the host spends `host_ms` launching it, the stream `gpu_ms` in it."""

    def call(*_: Any) -> None:
        clock.now += host_ms / 1000
        stream.queued += gpu_ms

    return call


def test_a_gpu_collectives_wait_is_the_streams_time_in_it_once_the_gpu_passed_it(
    timed_recorder: tuple[Recorder, Clock, Stream],
) -> None:
    recorder, clock, stream = timed_recorder
    all_reduce = _timed(collective(clock, stream, host_ms=1, gpu_ms=30), "all_reduce", lambda: False)
    recorder.mark("optimizer")
    stream.queued += 20  # the step's compute, queued
    clock.now += 0.002
    all_reduce(Tensor(is_cuda=True))
    clock.now += 0.100  # the host runs on, and waits for its GPU at last (loss.item())
    recorder.mark("optimizer")  # the GPU has not passed the collective yet: nothing read
    assert recorder.compute[-1] == pytest.approx(0.103)
    stream.executed = stream.queued
    clock.now += 0.100
    recorder.mark("optimizer")  # now it has: the 30 ms on the stream are the wait
    assert recorder.compute[-1] == pytest.approx(0.070)
    assert recorder.summary(0.0)["waiting"] == ""


def test_a_work_wait_is_timed_where_the_last_collective_with_a_tensor_ran(
    timed_recorder: tuple[Recorder, Clock, Stream],
) -> None:
    recorder, clock, stream = timed_recorder
    launch = _timed(collective(clock, stream, host_ms=0, gpu_ms=0), "all_reduce", lambda: False)
    wait = _timed(collective(clock, stream, host_ms=40, gpu_ms=25), "wait", lambda: False)
    recorder.mark("optimizer")
    launch(Tensor(is_cuda=False))  # gloo: the host's time in wait() is the wait
    wait(object())
    stream.executed = stream.queued
    recorder.mark("optimizer")
    assert recorder.compute[-1] == pytest.approx(0.0)
    launch([Tensor(is_cuda=True)])  # NCCL, a list of tensors: the stream's time is
    wait(object())
    stream.executed = stream.queued
    clock.now += 0.010
    recorder.mark("optimizer")
    assert recorder.compute[-1] == pytest.approx(0.050 - 0.025)


def test_a_nested_or_tensorless_call_is_timed_on_the_host(timed_recorder: tuple[Recorder, Clock, Stream]) -> None:
    recorder, clock, stream = timed_recorder
    barrier = _timed(collective(clock, stream, host_ms=50, gpu_ms=0), "barrier", lambda: False)
    inner = _timed(collective(clock, stream, host_ms=0, gpu_ms=10), "all_gather", lambda: False)

    def object_collective(*_: Any) -> None:
        inner([Tensor(is_cuda=True)])  # inside all_gather_object: counted by the outer call
        clock.now += 0.020

    outer = _timed(object_collective, "all_gather_object", lambda: False)
    recorder.mark("optimizer")
    barrier()
    outer([object()])
    stream.executed = stream.queued
    recorder.mark("optimizer")
    assert recorder.compute[-1] == pytest.approx(0.0) and len(recorder.compute) == 1


def test_a_new_round_forgets_the_waits_of_the_last() -> None:
    stream = Stream()
    waits = GpuWaits(stream.event)
    start = waits.start()
    stream.queued += 5
    waits.end(start)
    waits.forget()
    stream.executed = stream.queued
    assert waits.harvest() == 0.0


class Future:
    def __init__(self, value: object) -> None:
        self._value = value

    def value(self) -> object:
        return self._value

    def then(self, callback: Callable[[Future], object]) -> Future:
        return Future(callback(self))  # a done future runs its callback at once


class Bucket:
    def __init__(self, last: bool) -> None:
        self._last = last

    def buffer(self) -> Tensor:
        return Tensor(is_cuda=True)

    def is_last(self) -> bool:
        return self._last


def test_a_ddp_gpu_buckets_wait_runs_from_the_last_launch_to_its_all_reduces_end() -> None:
    stream = Stream()
    waits = GpuWaits(stream.event)
    host_waits: list[float] = []
    bucket_waits = BucketWaits(host_waits.append, lambda: waits)

    def hook(_: object, bucket: Bucket) -> Future:
        stream.queued += 5 if not bucket.is_last() else 0  # backward goes on between buckets
        stream.queued += 12  # the bucket's all-reduce, waiting for the slow peer
        return Future(bucket)

    timed = bucket_waits.wrap(hook, Bucket)
    assert timed(None, Bucket(last=False)).value() is not None
    last = Bucket(last=True)
    assert timed(None, last).value() is last  # the hook's value goes through
    stream.executed = stream.queued
    assert waits.harvest() == pytest.approx(0.012) and host_waits == []


def test_on_cuda_reads_a_tensor_or_a_list_and_nothing_else() -> None:
    assert on_cuda(Tensor(is_cuda=True)) is True
    assert on_cuda([Tensor(is_cuda=False)]) is False
    assert on_cuda([]) is None and on_cuda(object()) is None and on_cuda(None) is None
