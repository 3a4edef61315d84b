"""[Note: stream order checked] (offload/machine/stream_check.py): on the emulated GPU a copy stream's work that is
not ordered after the compute stream's conflicting access fails, though the CPU ran compute first; ordered by an
event it passes; host memory and reads beside reads are left alone."""

import time

import pytest
import torch

from offload.machine.accelerator import Accelerator, StreamError
from offload.machine.stream_check import ENV, StreamOrderError


@pytest.fixture
def accel(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", "1")
    a = Accelerator("cpu")
    assert a.check is not None
    yield a
    a.close()


def _ran(event):
    """Until ``event`` completes, without a wait the check sees (a CPU's compute ran first: a GPU's need not)."""
    while not event.query():
        time.sleep(0.001)


def _host(accel, value):
    host = accel.host_buffer(1024, torch.float32)[0]
    return host.fill_(value)


def test_a_copy_over_what_compute_read_fails_unless_it_waits_for_compute(accel):
    device, host = torch.ones(1024), _host(accel, 0.0)
    stream = accel.copy_stream("up")
    _ = device * 2  # compute reads it
    stream.run(lambda: device.copy_(host, non_blocking=True))  # and a copy overwrites it, in no order
    with pytest.raises(StreamError, match="up writes device bytes .* that compute (wrote|read) in aten"):
        stream.synchronize()

    ordered, again = accel.copy_stream("up, after compute"), torch.ones(1024)
    _ = again * 2
    ordered.wait_event(accel.compute_event())
    ordered.run(lambda: again.copy_(host, non_blocking=True))
    ordered.synchronize()
    assert torch.equal(again, host)


def test_compute_over_what_a_copy_wrote_fails_unless_it_waits_for_the_copy(accel):
    device, host = torch.empty(1024), _host(accel, 1.0)  # allocated, not written
    stream = accel.copy_stream("up")
    stream.run(lambda: device.copy_(host, non_blocking=True))
    _ran(stream.record())
    with pytest.raises(StreamOrderError, match="compute reads device bytes .* that up wrote in aten.copy_"):
        _ = device + 1
    other = torch.empty(1024)
    stream.run(lambda: other.copy_(host, non_blocking=True))
    accel.compute_wait(stream.record())
    assert torch.equal(other + 1, host + 1)


def test_the_order_passes_from_stream_to_stream_through_events(accel):
    """A copy ordered after another stream's event, which was ordered after compute: no conflict."""
    device, host = torch.ones(1024), _host(accel, 0.0)
    first, second = accel.copy_stream("first"), accel.copy_stream("second")
    _ = device * 2
    first.wait_event(accel.compute_event())
    second.wait_event(first.record())
    second.run(lambda: device.copy_(host, non_blocking=True))
    second.synchronize()


def test_host_memory_and_reads_beside_reads_are_not_checked(accel):
    host, device = _host(accel, 3.0), torch.empty(1024)  # the host writes its own memory, then a copy reads it
    stream = accel.copy_stream("down")
    stream.run(lambda: device.copy_(host, non_blocking=True))
    stream.synchronize()
    accel.compute_wait(stream.record())
    _ = device * 2  # compute reads, and a copy reads too
    stream.run(lambda: host.copy_(device, non_blocking=True))
    stream.synchronize()
    assert torch.equal(host, device)


def test_a_closed_engine_checks_nothing_more(accel):
    device, host = torch.empty(1024), _host(accel, 0.0)
    stream = accel.copy_stream("up")
    stream.run(lambda: device.copy_(host, non_blocking=True))
    _ran(stream.record())
    accel.check.close()
    _ = device + 1  # would conflict: not checked once closed
