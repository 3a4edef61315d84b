"""[Note: stream order checked] (offload/machine/stream_check.py): on the emulated GPU a copy stream's work that is
not ordered after the compute stream's conflicting access fails, though the CPU ran compute first; ordered by an
event it passes; host memory and reads beside reads are left alone."""

import gc
import time

import pytest
import torch

from offload.machine import stream_check
from offload.machine.accelerator import Accelerator, StreamError
from offload.machine.buffers import AlignedBuffer
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


def test_an_out_argument_is_a_write(accel):
    device, host = torch.empty(1024), _host(accel, 1.0)
    stream = accel.copy_stream("up")
    stream.run(lambda: device.copy_(host, non_blocking=True))
    _ran(stream.record())
    with pytest.raises(StreamOrderError, match="compute writes device bytes .* that up wrote in aten.copy_"):
        torch.mul(torch.ones(1024), 2, out=device)


def test_a_strided_view_covers_the_bytes_from_its_first_element_to_its_last(accel):
    """Compute reads the left half of each row of an 8 x 128 tensor: from row 0's first element to row 7's 64th.
    A copy may write what lies past that without a wait; within it, it must wait."""
    device, host = torch.ones(8, 128), _host(accel, 0.0)
    past, within = accel.copy_stream("past the last element"), accel.copy_stream("within")
    for stream in (past, within):  # after the fill
        stream.wait_event(accel.compute_event())
    _ = device[:, :64] * 2
    past.run(lambda: device[7, 64:].copy_(host[:64], non_blocking=True))
    past.synchronize()
    within.run(lambda: device[6, 64:].copy_(host[:64], non_blocking=True))
    with pytest.raises(StreamError, match="within writes device bytes .* that compute read in aten.mul"):
        within.synchronize()


def test_a_host_buffer_is_forgotten_once_its_memory_is_gone(accel):
    """Host buffers are left out by their storage, until they are freed: the memory may then hold device tensors."""
    buffers = [AlignedBuffer(4096) for _ in range(3)]
    keys = {stream_check._storage(b.tensor) for b in buffers}
    assert keys <= stream_check._HOST
    del buffers
    gc.collect()
    assert not keys & stream_check._HOST
