"""The stores as rooms of their own (issue #19): ParamSwap, OptimizerStateStore and ParamStore built directly (no
Engine, no model) over a real swap directory and an I/O engine that injects the faults a real disk gives: ENOSPC
on a write (torn: part of it lands first), EIO on a read, and bytes written wrong that only the checksum catches.

What every test holds the stores to: a value that round-trips comes back bitwise; a step's new values become
current only when it commits; a failed step leaves the last completed one readable; a failure names the file."""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass

import pytest
import torch

from offload.aio.base import IOEngine, Request, SwapFile, SwapIOError, check_request, split
from offload.aio.checksum import ChecksumError, ChecksummedFile
from offload.aio.threads import ThreadPoolEngine
from offload.config import Config, ConfigError
from offload.machine.accelerator import Accelerator, DoneEvent
from offload.machine.buffers import AlignedBuffer, round_up
from offload.observe.telemetry import Telemetry
from offload.store.budget import BudgetExceeded, TierBudget
from offload.store.optimizer_state import OptimizerStateStore
from offload.store.param_homes import WRITE_BUFFERS, param_buffer_bytes
from offload.store.param_store import ParamStore
from offload.store.param_swap import BufferState, ParamSwap, ParamSwapError
from offload.store.placement import Shards, plan
from offload.store.sub_groups import place_sub_groups, plan_sub_groups
from offload.store.swapdir import SwapDir, TierRoom
from offload.store.tier import Tier

KINDS = 3  # master, exp_avg, exp_avg_sq: the fp32 state these rooms are tested with

BLOCK = 4096  # the engine's block: most units below span two or three, so requests have several pieces
DTYPE = torch.bfloat16
PARAMS = "params-rank0.swap"
OPTIMIZER = "optimizer-rank0.swap"
# Shards of 3000, 2500, 4100 and 1000 bf16 elements: 2, 2, 3 and 1 blocks on the wire.
UNITS = [(0, 3000), (1, 2500), (2, 4100), (3, 1000)]


# ------------------------------------------------------------------ the fault-injecting engine

@dataclass
class Fault:
    """Fails (``err``) or corrupts the matching requests: ``op`` and, when given, the swap file's name and the
    request's file offset. The first ``skip`` matching requests pass; the next ``times`` (None: all) are hit."""

    op: str
    err: int | None = None  # None: corrupt the bytes written instead
    file: str | None = None
    offset: int | None = None
    skip: int = 0
    times: int | None = 1
    seen: int = 0
    hits: int = 0

    def matches(self, op: str, path: str, offset: int) -> bool:
        if op != self.op or (self.file is not None and os.path.basename(path) != self.file):
            return False
        if self.offset is not None and offset != self.offset:
            return False
        self.seen += 1
        if self.seen <= self.skip or (self.times is not None and self.hits >= self.times):
            return False
        self.hits += 1
        return True


@dataclass
class Call:
    op: str
    file: str
    offset: int
    length: int
    address: int  # the host buffer's address: which buffer a read landed in
    fault: str  # "", "error" or "corrupt"


class FaultyEngine(IOEngine):
    """A real ThreadPoolEngine behind a wrapper that fails or corrupts chosen requests, logs every request, counts
    the requests in flight per file, and can hold reads back (``hold``) so that read-ahead stays in flight.

    Every request goes through a thread of the wrapper that runs the real transfer on the inner engine (without
    the verify hook) and then finishes the caller's request piece by piece through its verify hook, so a
    ChecksummedFile checks what landed exactly as with a real engine."""

    name = "faulty"

    def __init__(self, inner: IOEngine) -> None:
        self.inner = inner
        self.block_size = inner.block_size
        self.faults: list[Fault] = []
        self.log: list[Call] = []
        self.in_flight: dict[tuple[str, str], int] = {}
        self.max_in_flight: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._held = threading.Event()
        self._held.set()
        self._threads: list[threading.Thread] = []

    # -- what a test asks for

    def fail(self, op: str, err: int | None = None, **where) -> Fault:
        """Fail matching requests with the errno a disk gives: ENOSPC for a write, EIO for a read."""
        fault = Fault(op, err if err is not None else (errno.ENOSPC if op == "write" else errno.EIO), **where)
        self.faults.append(fault)
        return fault

    def corrupt(self, **where) -> Fault:
        """Write matching writes with one byte flipped (the checksum was computed from the right bytes)."""
        fault = Fault("write", None, **where)
        self.faults.append(fault)
        return fault

    def hold(self) -> None:
        """Reads submitted from now on start only after ``release``."""
        self._held.clear()

    def release(self) -> None:
        self._held.set()

    def calls(self, op: str, file: str) -> list[Call]:
        with self._lock:
            return [c for c in self.log if c.op == op and c.file == file]

    # -- the engine

    def submit(self, op: str, file: SwapFile, buffer: torch.Tensor, offset: int, length: int,
               verify=None) -> Request:
        address = check_request(op, file, buffer, offset, length)
        name = os.path.basename(file.path)
        with self._lock:
            fault = next((f for f in self.faults if f.matches(op, file.path, offset)), None)
            kind = "" if fault is None else "error" if fault.err is not None else "corrupt"
            self.log.append(Call(op, name, offset, length, address, kind))
            key = (op, name)
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
            self.max_in_flight[key] = max(self.max_in_flight.get(key, 0), self.in_flight[key])
        request = Request(op, file, offset, length, buffer, verify=verify)
        pieces = split(request, address, self.block_size)
        held = op == "read" and not self._held.is_set()

        def run() -> None:
            if held:
                self._held.wait(30)
            error = None
            try:
                if fault is not None and fault.err is not None:
                    error = self._fail(op, fault.err, file, buffer, offset, length, len(pieces))
                else:
                    source = self._corrupted(buffer, length) if fault is not None else buffer
                    inner = self.inner.submit(op, file, source, offset, length)
                    try:
                        inner.wait(30)
                    except SwapIOError as e:
                        error = e
            finally:
                with self._lock:
                    self.in_flight[key] -= 1
            for piece in pieces:
                request.finish_piece(piece, error)

        thread = threading.Thread(target=run, name="faulty-aio", daemon=True)
        self._threads.append(thread)
        thread.start()
        return request

    def _fail(self, op: str, err: int, file: SwapFile, buffer: torch.Tensor, offset: int, length: int,
              pieces: int) -> SwapIOError:
        """A torn failure: the first half of the pieces really transfer, the rest fail with ``err``."""
        done = min(pieces // 2 * self.block_size, length)
        if done:
            self.inner.submit(op, file, buffer, offset, done).wait(30)
        return SwapIOError(err, file.path, offset + done, length - done, op)

    @staticmethod
    def _corrupted(buffer: torch.Tensor, length: int) -> torch.Tensor:
        copy = AlignedBuffer(length)
        copy.tensor[:length].copy_(buffer.view(torch.uint8)[:length])
        copy.tensor[length // 2] ^= 0x5A
        copy_tensor = copy.tensor
        copy_tensor._keep = copy  # the mmap lives as long as the request's tensor
        return copy_tensor

    def close(self) -> None:
        self.release()
        for t in self._threads:
            t.join(30)
        self.inner.close()


class Gate:
    """An event the test opens itself: a compute stream that has not reached the point a copy waits for."""

    def __init__(self) -> None:
        self._open = threading.Event()

    def open(self) -> None:
        self._open.set()

    def open_after(self, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, self.open)
        timer.start()
        return timer

    def synchronize(self) -> None:
        if not self._open.wait(30):
            raise TimeoutError("the test never opened the gate")

    def query(self) -> bool:
        return self._open.is_set()


class Watched:
    """A copy stream that counts the copies that have run on it."""

    def __init__(self, stream) -> None:
        self.stream, self.name, self.ran = stream, stream.name, 0

    def run(self, fn) -> None:
        def counted() -> None:
            fn()
            self.ran += 1

        self.stream.run(counted)

    def record(self, into=None):
        return self.stream.record(into)

    def wait_event(self, event) -> None:
        self.stream.wait_event(event)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.stream.close()


class Rooms:
    """A swap directory on tmp_path, the faulty engine, and the stores built over them (closed in reverse)."""

    def __init__(self, root) -> None:
        self.swap_dir = SwapDir(root / "nvme", name="offload-swap-test")
        self.engine = FaultyEngine(ThreadPoolEngine(block_size=BLOCK, threads=2))
        self.gates: list[Gate] = []
        self._closers: list = []

    @property
    def swap(self) -> tuple[SwapDir, IOEngine]:
        return self.swap_dir, self.engine

    def file(self, name: str) -> str:
        return str(self.swap_dir.path / name)

    def param_swap(self, sizes=UNITS, *, buffer_count: int = 2, host: TierBudget | None = None,
                   nvme: TierBudget | None = None) -> ParamSwap:
        swap = ParamSwap(list(sizes), DTYPE, TierRoom(host or TierBudget(Tier.HOST, None),
                                                      nvme or TierBudget(Tier.NVME, None), self.swap, 0, buffer_count),
                         pin=False, telemetry=Telemetry())
        self._closers.append(swap.close)
        return swap

    def accel(self) -> Accelerator:
        accel = Accelerator("cpu")
        self._closers.append(accel.close)
        return accel

    def optimizer(self, sizes, sub_group_size: int, *, device: str = "nvme", buffer_count: int = 2,
                  host: TierBudget | None = None, nvme: TierBudget | None = None) -> OptimizerStateStore:
        host = host or TierBudget(Tier.HOST, None)
        groups = plan_sub_groups(list(sizes), sub_group_size)
        place_sub_groups(groups, device, host, buffer_count)  # as the placement plan does
        store = OptimizerStateStore(groups, TierRoom(host, nvme or TierBudget(Tier.NVME, None), self.swap, 0,
                                                     buffer_count), accel=self.accel(), telemetry=Telemetry())
        self._closers.append(store.close)
        return store

    def param_store(self, homes: dict[int, Tier], swap: ParamSwap | None, accel: Accelerator | None = None,
                    host: TierBudget | None = None, keep_host_copies: bool = False) -> ParamStore:
        store = ParamStore(accel or self.accel(), DTYPE, homes, swap=swap, host=host or TierBudget(Tier.HOST, None),
                           telemetry=Telemetry(), keep_host_copies=keep_host_copies)
        self._closers.append(store.close)
        return store

    def gate(self) -> Gate:
        gate = Gate()
        self.gates.append(gate)
        return gate

    def close(self) -> None:
        for gate in self.gates:
            gate.open()
        self.engine.release()
        for close in reversed(self._closers):
            close()
        self.engine.close()
        self.swap_dir.close()


@pytest.fixture
def rooms(tmp_path):
    r = Rooms(tmp_path)
    yield r
    r.close()


def values(numel: int, seed: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen).to(dtype)


def shards(seed: int, sizes=UNITS) -> dict[int, torch.Tensor]:
    return {unit: values(n, seed * 100 + unit) for unit, n in sizes}


def load(swap: ParamSwap, new: dict[int, torch.Tensor]) -> None:
    for unit, v in new.items():
        swap.overwrite(unit, v)


def step(swap: ParamSwap, new: dict[int, torch.Tensor]) -> None:
    """One step's writes, as the optimizer does them: stage, fill, write, unit after unit."""
    for unit, v in new.items():
        swap.stage(unit).copy_(v)
        swap.write(unit)


def assert_current(swap: ParamSwap, expected: dict[int, torch.Tensor]) -> None:
    for unit, v in expected.items():
        got = swap.read_copy(unit)
        assert got.dtype == DTYPE and torch.equal(got, v), f"unit {unit} does not read back bitwise"


# ------------------------------------------------------------------ the fault engine itself

def test_the_fault_engine_fails_tears_corrupts_and_passes_through_as_asked(rooms):
    f = rooms.swap_dir.reserve("probe.swap", 8 * BLOCK)
    checked = ChecksummedFile(rooms.engine, f)
    try:
        src = AlignedBuffer(2 * BLOCK)
        src.tensor.copy_(torch.arange(2 * BLOCK, dtype=torch.int64).remainder(251).to(torch.uint8))
        checked.write(src.tensor, 0, 2 * BLOCK).wait()
        back = AlignedBuffer(2 * BLOCK)
        checked.read(back.tensor, 0, 2 * BLOCK).wait()
        assert torch.equal(back.tensor, src.tensor)

        rooms.engine.fail("write", file="probe.swap", offset=2 * BLOCK)
        with pytest.raises(SwapIOError) as e:
            checked.write(src.tensor, 2 * BLOCK, 2 * BLOCK).wait()
        assert e.value.errno == errno.ENOSPC and e.value.path == f.path and e.value.op == "write"
        assert e.value.offset == 3 * BLOCK  # torn: its first block landed, the error names where it stopped

        rooms.engine.fail("read", file="probe.swap")
        with pytest.raises(SwapIOError, match=r"read of .*probe\.swap failed: .*\[errno 5 EIO\]"):
            checked.read(back.tensor, 0, 2 * BLOCK).wait()

        rooms.engine.corrupt(file="probe.swap")
        checked.write(src.tensor, 4 * BLOCK, 2 * BLOCK).wait()  # lands "successfully", one byte wrong
        with pytest.raises(ChecksumError, match="checksum mismatch"):
            checked.read(back.tensor, 4 * BLOCK, 2 * BLOCK).wait()
        checked.read(back.tensor, 0, 2 * BLOCK).wait()  # every fault was used up: requests pass again
        assert torch.equal(back.tensor, src.tensor)
        assert [c.fault for c in rooms.engine.log] == ["", "", "error", "error", "corrupt", "", ""]
    finally:
        checked.close()


# ------------------------------------------------------------------ ParamSwap

def test_param_swap_overwrite_then_read_copy_is_bitwise_and_a_fresh_tensor(rooms):
    swap = rooms.param_swap()
    first, second = shards(1), shards(2)
    load(swap, first)
    assert_current(swap, first)
    load(swap, second)  # the other slot now
    assert_current(swap, second)
    copy = swap.read_copy(0)
    copy.zero_()
    assert torch.equal(swap.read_copy(0), second[0])
    assert swap.stats.stale == set()


def test_param_swap_commit_makes_the_step_current_and_the_old_slot_is_never_read_again(rooms):
    swap = rooms.param_swap(buffer_count=2)
    old, new = shards(1), shards(2)
    load(swap, old)
    step(swap, new)
    assert_current(swap, old)  # written but not committed: the old values are current
    assert swap.read_ahead([0, 1]) == 2  # read-ahead of the old values, still unused when the step commits
    old_slots = {unit: swap.file.slots[unit].current_offset for unit in swap.homes}
    swap.commit()
    for unit in new:  # the old slot of every unit now fails any read: the test fails if anything reads it
        rooms.engine.fail("read", file=PARAMS, offset=old_slots[unit], times=None)
    assert_current(swap, new)
    assert swap.stats.wasted_reads == 2  # the read-ahead of old values was dropped, never used
    assert swap.telemetry.snapshot().bytes["nvme_read_wasted"] == swap.homes[0].nbytes + swap.homes[1].nbytes
    assert all(c.fault == "" for c in rooms.engine.calls("read", PARAMS))


def test_param_swap_abort_after_writes_keeps_the_old_values_and_the_retry_commits(rooms):
    swap = rooms.param_swap()
    old, new = shards(1), shards(2)
    load(swap, old)
    rooms.engine.fail("write", file=PARAMS, skip=1)  # one of the aborted step's writes fails too: not reported
    step(swap, new)
    swap.abort()
    assert_current(swap, old)
    assert swap.stats.stale == set()
    step(swap, new)  # the retried step
    swap.commit()
    assert_current(swap, new)


def test_param_swap_failed_write_raises_on_commit_and_makes_exactly_that_unit_stale(rooms):
    swap = rooms.param_swap()
    old, new = shards(1), shards(2)
    load(swap, old)
    rooms.engine.fail("write", file=PARAMS, offset=swap.file.slots[1].next_offset)  # ENOSPC, torn
    step(swap, new)
    with pytest.raises(ParamSwapError) as e:
        swap.commit()
    assert isinstance(e.value, SwapIOError)
    assert e.value.errno == errno.ENOSPC and e.value.path == rooms.file(PARAMS) and e.value.op == "write"
    assert "1 unit shard(s) not written" in str(e.value)
    assert swap.stats.stale == {1}
    assert_current(swap, {u: new[u] for u in (0, 2, 3)})
    with pytest.raises(RuntimeError, match="unit 1's parameter shard on NVMe is stale"):
        swap.fetch(1)
    before = len(rooms.engine.calls("read", PARAMS))
    assert swap.read_ahead([1, 0]) == 1  # the stale unit is never read ahead
    assert [c.offset for c in rooms.engine.calls("read", PARAMS)[before:]] == [
        swap.file.slots[0].current_offset]
    step(swap, {0: old[0]})  # the next step commits without re-raising the old failure
    swap.commit()
    assert swap.stats.stale == {1}
    assert torch.equal(swap.read_copy(0), old[0])


def test_param_swap_overwrite_of_a_stale_unit_clears_it(rooms):
    swap = rooms.param_swap()
    old, new = shards(1), shards(2)
    load(swap, old)
    rooms.engine.fail("write", file=PARAMS, skip=2)  # unit 2's write (the third of the step)
    step(swap, new)
    with pytest.raises(ParamSwapError):
        swap.commit()
    assert swap.stats.stale == {2}
    master = values(4100, 99)  # what the master weights say unit 2 is now
    swap.overwrite(2, master)
    assert swap.stats.stale == set()
    assert torch.equal(swap.read_copy(2), master)
    assert swap.read_ahead([2]) == 1
    assert torch.equal(swap.view(swap.fetch(2)), master)


def test_param_swap_failed_overwrite_raises_and_the_unit_keeps_its_values(rooms):
    swap = rooms.param_swap()
    old = shards(1)
    load(swap, old)
    rooms.engine.fail("write", file=PARAMS)
    with pytest.raises(SwapIOError) as e:
        swap.overwrite(0, values(3000, 5))
    assert e.value.errno == errno.ENOSPC and e.value.path == rooms.file(PARAMS)
    assert_current(swap, old)


def test_param_swap_failed_read_ahead_is_retried_by_fetch(rooms):
    swap = rooms.param_swap()
    old = shards(1)
    load(swap, old)
    rooms.engine.fail("read", file=PARAMS)  # EIO on the read-ahead of unit 0
    assert swap.read_ahead([0, 1]) == 2
    b = swap.fetch(0)
    assert torch.equal(swap.view(b), old[0])
    assert swap.stats.reads_on_demand == 1  # the one retry
    assert [c.fault for c in rooms.engine.calls("read", PARAMS)] == ["error", "", ""]
    assert torch.equal(swap.view(swap.fetch(1)), old[1])


def test_param_swap_second_read_failure_raises_swap_io_error_naming_the_file(rooms):
    swap = rooms.param_swap()
    old = shards(1)
    load(swap, old)
    rooms.engine.fail("read", file=PARAMS, offset=swap.file.slots[2].current_offset, times=2)
    assert swap.read_ahead([2]) == 1
    with pytest.raises(SwapIOError) as e:
        swap.fetch(2)
    assert e.value.errno == errno.EIO and e.value.path == rooms.file(PARAMS) and e.value.op == "read"
    assert PARAMS in str(e.value) and "[errno 5 EIO]" in str(e.value)
    assert all(b.state is BufferState.FREE for b in swap._reads)  # the failed read gave its buffer back
    assert torch.equal(swap.read_copy(2), old[2])  # the disk is fine again: the same values, read again


def test_param_swap_a_corrupted_slot_is_caught_by_the_checksum_never_read_wrong(rooms):
    swap = rooms.param_swap()
    old = shards(1)
    load(swap, old)
    rooms.engine.corrupt(file=PARAMS)
    swap.overwrite(3, values(1000, 7))  # the write "succeeds" with one byte wrong on disk
    with pytest.raises(ChecksumError, match=rf"{PARAMS} failed: checksum mismatch"):
        swap.read_copy(3)
    assert_current(swap, {u: old[u] for u in (0, 1, 2)})


def test_param_swap_read_ahead_never_takes_more_than_buffer_count_buffers(rooms):
    swap = rooms.param_swap(buffer_count=2)
    old = shards(1)
    load(swap, old)
    rooms.engine.hold()  # the disk is slow: read-ahead stays in flight
    assert swap.read_ahead([3, 2, 1, 0]) == 2
    reads = rooms.engine.calls("read", PARAMS)
    assert [c.offset for c in reads] == [swap.file.slots[u].current_offset for u in (3, 2)]
    assert swap.read_ahead([3, 2, 1, 0]) == 0  # nothing free: it never waits and never starts more
    rooms.engine.release()
    h2d = DoneEvent()
    for unit in (3, 2, 1, 0, 2, 3):
        b = swap.fetch(unit)
        assert torch.equal(swap.view(b), old[unit])
        swap.copied(b, h2d)
    reads = rooms.engine.calls("read", PARAMS)
    assert len({c.address for c in reads}) == 2  # every read landed in one of the two read buffers
    assert rooms.engine.max_in_flight[("read", PARAMS)] <= 2


def test_param_swap_a_unit_fetched_twice_reuses_its_buffer_without_a_second_read(rooms):
    swap = rooms.param_swap(buffer_count=2)
    old = shards(1)
    load(swap, old)
    b = swap.fetch(1)
    swap.copied(b, DoneEvent())
    reads = len(rooms.engine.calls("read", PARAMS))
    again = swap.fetch(1)
    assert again is b and swap.stats.reuses == 1
    assert len(rooms.engine.calls("read", PARAMS)) == reads
    assert torch.equal(swap.view(again), old[1])
    swap.copied(again, DoneEvent())
    swap.overwrite(1, old[0][:2500])  # new values: the buffer no longer holds the unit
    assert torch.equal(swap.view(swap.fetch(1)), old[0][:2500])
    assert swap.stats.reuses == 1 and len(rooms.engine.calls("read", PARAMS)) == reads + 1


def test_param_swap_a_buffer_is_not_read_into_while_its_copy_may_still_read_it(rooms, monkeypatch):
    monkeypatch.setenv("OFFLOAD_EMULATED_COPY_DELAY_S", "0.1")
    h2d = rooms.accel().copy_stream("h2d")
    swap = rooms.param_swap(buffer_count=1)
    old = shards(1)
    load(swap, old)
    b = swap.fetch(0)
    out = torch.empty(3000, dtype=DTYPE)
    source = swap.view(b)
    h2d.run(lambda: out.copy_(source))  # runs 0.1 s from now
    swap.copied(b, h2d.record())
    assert torch.equal(swap.view(swap.fetch(1)), old[1])  # the only buffer: waits for the copy, then reads
    assert torch.equal(out, old[0])


def test_param_swap_fetch_past_read_ahead_drops_a_guess_and_never_gives_a_wrong_value(rooms):
    swap = rooms.param_swap(buffer_count=2)
    old = shards(1)
    load(swap, old)
    assert swap.read_ahead([0, 1]) == 2
    b = swap.fetch(3)  # not read ahead, every buffer busy: one read-ahead is dropped
    assert torch.equal(swap.view(b), old[3]) and swap.stats.wasted_reads == 1
    swap.copied(b, DoneEvent())
    for unit in (0, 1):
        b = swap.fetch(unit)
        assert torch.equal(swap.view(b), old[unit])
        swap.copied(b, DoneEvent())


# ------------------------------------------------------------------ OptimizerStateStore

OPT_UNITS = [(0, 700), (1, 300), (2, 1000), (3, 600), (4, 400), (5, 1000)]  # sub-groups of 1000: 4 of them


def masters(seed: int) -> dict[int, torch.Tensor]:
    return {unit: values(n, seed * 100 + unit, torch.float32) for unit, n in OPT_UNITS}


def built(rooms, units=OPT_UNITS, **kw) -> tuple[OptimizerStateStore, dict[int, torch.Tensor]]:
    """A store whose state is the masters of seed 1 with zero moments; returns it and each sub-group's state."""
    store = rooms.optimizer(units, 1000, **kw)
    m = {unit: values(n, 100 + unit, torch.float32) for unit, n in units}
    for unit, master in m.items():
        store.init_member(unit, master)
    state = {}
    for g in store.groups:
        s = torch.zeros(KINDS, g.numel)
        for member in g.members:
            s[0, member.offset:member.offset + member.numel] = m[member.unit]
        state[g.index] = s
    return store, state


def adam_like(resident: torch.Tensor, k: int) -> None:
    """A stand-in for Adam: changes all three rows, deterministically (so reference and store agree bitwise)."""
    resident[1].mul_(0.9).add_(resident[0], alpha=0.1)
    resident[2].mul_(0.99).add_(float(k))
    resident[0].sub_(resident[1], alpha=1e-2)


def stepped(state: dict[int, torch.Tensor], k: int) -> dict[int, torch.Tensor]:
    out = {}
    for i, s in state.items():
        s = s.clone()
        adam_like(s, k)
        out[i] = s
    return out


def read_state(store: OptimizerStateStore) -> dict[int, torch.Tensor]:
    return {g.index: torch.stack(list(g.resident)) for g in store.one_at_a_time(read=True, write=False)}


def assert_state(store: OptimizerStateStore, expected: dict[int, torch.Tensor]) -> None:
    got = read_state(store)
    assert got.keys() == expected.keys()
    for i in expected:
        assert torch.equal(got[i], expected[i]), f"sub-group {i} does not read back bitwise"
    for g in store.groups:
        for member in g.members:
            s = expected[g.index][0, member.offset:member.offset + member.numel]
            assert torch.equal(store.read_master(member.unit), s)


def run_pass(store: OptimizerStateStore, k: int) -> list[int]:
    seen = []
    for g in store.step_pass():
        seen.append(g.index)
        adam_like(g.resident, k)
    return seen


def test_optimizer_nvme_step_pass_commits_and_reads_back_bitwise(rooms):
    store, state = built(rooms, buffer_count=2)
    assert [g.tier for g in store.groups] == [Tier.NVME] * 4
    assert_state(store, state)
    for k in (1, 2, 3):
        assert run_pass(store, k) == [3, 2, 1, 0]  # backward's order
        state = stepped(state, k)
        assert_state(store, state)
    assert rooms.engine.max_in_flight[("read", OPTIMIZER)] <= 2


def test_optimizer_read_ahead_is_taken_over_by_the_pass(rooms):
    store, state = built(rooms, buffer_count=2)
    rooms.engine.hold()
    before = len(rooms.engine.calls("read", OPTIMIZER))
    assert store.read_ahead() == 2
    assert store.read_ahead() == 0  # already begun
    rooms.engine.release()
    run_pass(store, 1)
    assert len(rooms.engine.calls("read", OPTIMIZER)) == before + 4  # each sub-group read once
    assert_state(store, stepped(state, 1))


@pytest.mark.parametrize("drop", ["settle", "forward order"])
def test_optimizer_read_ahead_dropped_unused_is_counted_as_wasted(rooms, drop):
    """Reads ahead that something else interrupts (a checkpoint settles the pass; an early step wants the
    forward's order) were read for nothing: the bench reports them beside nvme_read."""
    store, state = built(rooms, buffer_count=2)
    assert store.read_ahead() == 2  # backward's order: sub-groups 3 and 2
    if drop == "settle":
        store.drop_read_ahead()
    else:
        run = store.detach_pass()  # a new pass in the forward's order, run to its end unchanged
        assert run is not None and run.forward
        while run.remaining():
            run.release(run.take())
        run.finish()
    tel = store.telemetry.snapshot().bytes
    assert tel["nvme_read_wasted"] == store.groups[3].nbytes + store.groups[2].nbytes
    assert_state(store, state)


def test_an_aborted_pass_counts_what_it_read_and_wrote_for_nothing(rooms):
    """A wrong speculation (or a failed step) aborts the pass: the sub-groups it had read, and those it had written,
    are read and written again by the pass that steps them for real. The bench reports that as wasted."""
    store, state = built(rooms, buffer_count=2)
    passing = store.step_pass()
    first = next(passing)
    adam_like(first.resident, 1)
    second = next(passing)  # the first is released (written) as the pass goes on; the second is held
    in_flight = [g for g, *_ in store._pass.reading]
    handed = store.abort_pass()
    assert {g.index for g in handed} == {first.index, second.index}
    tel = store.telemetry.snapshot().bytes
    assert tel["nvme_write_wasted"] == first.nbytes
    assert tel["nvme_read_wasted"] == first.nbytes + second.nbytes + sum(g.nbytes for g in in_flight)
    assert_state(store, state)  # nothing flipped


@pytest.mark.parametrize("op, skip", [("write", 0), ("write", 3), ("read", 0), ("read", 2)])
def test_optimizer_failed_transfer_then_abort_pass_keeps_the_last_completed_step(rooms, op, skip):
    store, state = built(rooms, buffer_count=2)
    run_pass(store, 1)
    state = stepped(state, 1)  # the last completed step
    rooms.engine.fail(op, file=OPTIMIZER, skip=skip)
    seen = []
    with pytest.raises(SwapIOError) as e:
        for g in store.step_pass():
            seen.append(g.index)
            adam_like(g.resident, 2)
    assert e.value.errno == (errno.ENOSPC if op == "write" else errno.EIO)
    assert e.value.path == rooms.file(OPTIMIZER)
    handed = store.abort_pass()
    assert set(seen) <= {g.index for g in handed}  # what it had handed out is stepped again by a retry
    assert_state(store, state)  # bitwise the last completed step
    assert run_pass(store, 2) == [3, 2, 1, 0]  # the retry
    assert_state(store, stepped(state, 2))


# One large unit (an embedding's) and small ones: sub-groups of 5000, 700, 800 and 300 elements, whose states take
# 61440, 12288, 12288 and 4096 bytes on the wire; each buffer holds the largest.
PACKED_UNITS = [(0, 5000), (1, 700), (2, 800), (3, 300)]


@pytest.mark.parametrize("buffers, ahead", [(2, 4), (1, 3)])
def test_optimizer_small_sub_groups_pack_into_buffers_the_large_one_sizes(rooms, buffers, ahead):
    """Backward's order reads 300, 800 and 700 into the first buffer together (28672 of its 61440 bytes) and the
    5000 into the second; with one buffer, the 5000 waits until the three small ones are written. Every step
    reads back bitwise, and a transfer that fails mid-pass leaves the last completed step."""
    store, state = built(rooms, PACKED_UNITS, buffer_count=buffers)
    assert [g.numel for g in store.groups] == [5000, 700, 800, 300]
    rooms.engine.hold()
    assert store.read_ahead() == ahead  # one per buffer without packing: 2 and 1
    rooms.engine.release()
    for k in (1, 2):
        assert run_pass(store, k) == [3, 2, 1, 0]
        state = stepped(state, k)
        assert_state(store, state)
    rooms.engine.fail("write", file=OPTIMIZER, skip=2)
    with pytest.raises(SwapIOError):
        run_pass(store, 3)
    store.abort_pass()
    assert_state(store, state)
    assert run_pass(store, 3) == [3, 2, 1, 0]
    assert_state(store, stepped(state, 3))


def test_optimizer_corrupted_slot_is_caught_by_the_checksum(rooms):
    store, state = built(rooms, buffer_count=2)
    g = store.groups[1]
    rooms.engine.corrupt(file=OPTIMIZER, offset=store._file.slots[g.index].next_offset)
    run_pass(store, 1)  # the corrupt write "succeeds": its slot becomes current
    with pytest.raises(ChecksumError, match="checksum mismatch") as e:
        store.read_master(g.members[0].unit)
    assert e.value.path == rooms.file(OPTIMIZER)
    with pytest.raises(ChecksumError):
        list(store.one_at_a_time(read=True, write=False))
    good = stepped(state, 1)
    m = store.groups[2].members[0]
    assert torch.equal(store.read_master(m.unit), good[2][0, m.offset:m.offset + m.numel])


def test_optimizer_one_at_a_time_write_replaces_the_state_in_place(rooms):
    store, state = built(rooms, buffer_count=2)
    replaced = {i: torch.full_like(s, float(i) + 0.5) for i, s in state.items()}
    for g in store.one_at_a_time(read=False, write=True):
        assert g.resident is not None
        for kind, values in enumerate(g.resident):
            values.copy_(replaced[g.index][kind])
    assert_state(store, replaced)
    run_pass(store, 1)
    assert_state(store, stepped(replaced, 1))


def test_optimizer_host_and_nvme_sub_groups_step_together(rooms):
    nbytes = round_up(KINDS * 1000 * 4)
    host = TierBudget(Tier.HOST, 2 * nbytes + nbytes)  # two NVMe buffers and one sub-group on the host
    store, state = built(rooms, buffer_count=2, host=host)
    assert [g.tier for g in store.groups] == [Tier.HOST, Tier.NVME, Tier.NVME, Tier.NVME]
    assert host.used == host.limit
    assert run_pass(store, 1) == [3, 2, 1, 0]  # NVMe ones first, in backward's order, then the host one
    assert_state(store, stepped(state, 1))


# ------------------------------------------------------------------ ParamStore

def device_host_nvme(rooms, accel=None) -> tuple[ParamStore, dict[int, torch.Tensor]]:
    """Unit 0 on the device (with a host copy), 1 on the device alone, 2 on the host, 3 on NVMe; fp32 starts."""
    swap = rooms.param_swap([(3, 1000)], buffer_count=2)
    homes = {0: Tier.DEVICE, 1: Tier.DEVICE, 2: Tier.HOST, 3: Tier.NVME}
    store = rooms.param_store(homes, swap, accel)
    start = {unit: values(n, 10 + unit, torch.float32) for unit, n in UNITS}
    for unit, v in start.items():
        store.add(unit, f"u{unit}", v, host_copy=unit == 0)
    return store, start


def test_param_store_add_then_read_rounds_to_the_compute_dtype_in_every_home(rooms):
    store, start = device_host_nvme(rooms)
    for unit, v in start.items():
        got = store.read(unit)
        assert got.dtype == DTYPE and torch.equal(got, v.to(DTYPE)), f"unit {unit} ({store.home(unit)})"
    assert torch.equal(store.host_copy(0), start[0].to(DTYPE))
    assert store.host_copy(1) is None and store.host_copy(3) is None
    assert store.device_nbytes(3) == 0 and store.device_nbytes(0) == 3000 * 2


def test_param_store_overwrite_updates_every_copy(rooms):
    store, _ = device_host_nvme(rooms)
    new = {unit: values(n, 50 + unit, torch.float32) for unit, n in UNITS}
    for unit, v in new.items():
        store.overwrite(unit, v)
        assert torch.equal(store.read(unit), v.to(DTYPE)), f"unit {unit} ({store.home(unit)})"
    assert torch.equal(store.host_copy(0), new[0].to(DTYPE))  # both copies of the device home
    assert torch.equal(store._shards[0].device, new[0].to(DTYPE))
    assert torch.equal(store.host_copy(2), new[2].to(DTYPE))


def test_param_store_to_device_returns_values_whose_copy_is_complete(rooms, monkeypatch):
    monkeypatch.setenv("OFFLOAD_EMULATED_COPY_DELAY_S", "0.1")  # the copy lags: a missing wait reads garbage
    accel = rooms.accel()
    store, start = device_host_nvme(rooms, accel)
    h2d = Watched(accel.copy_stream("h2d"))
    for n, unit in enumerate((2, 3, 3), start=1):  # host, NVMe, NVMe again (its buffer reused)
        out = store.to_device(unit, h2d)
        assert h2d.ran == n, "to_device returned before its copy ran"
        assert out.device == accel.device and torch.equal(out, start[unit].to(DTYPE))
    assert store.swap.stats.reuses == 1
    new = values(1000, 77, torch.float32)
    store.overwrite(3, new)  # the buffer a copy read no longer stands for the unit
    assert torch.equal(store.to_device(3, h2d), new.to(DTYPE))
    assert torch.equal(store.to_device(0, None), start[0].to(DTYPE))  # a device home needs no copy


def test_param_store_failed_read_raises_in_to_device_and_the_next_one_works(rooms):
    accel = rooms.accel()
    store, start = device_host_nvme(rooms, accel)
    h2d = Watched(accel.copy_stream("h2d"))
    rooms.engine.fail("read", file=PARAMS, times=2)
    with pytest.raises(SwapIOError, match=PARAMS):
        store.to_device(3, h2d)
    assert h2d.ran == 0  # nothing was copied from a failed read
    assert torch.equal(store.to_device(3, h2d), start[3].to(DTYPE))


def gated_copy_back(rooms, store: ParamStore, unit: int, new: torch.Tensor):
    """The step wrote ``new`` into the device home's host copy; its copy back waits behind a closed gate."""
    target = store.step_target(unit)
    assert target is store.host_copy(unit)
    target.copy_(new)
    store.wrote(unit)  # a no-op for a device home
    gate = rooms.gate()  # the compute stream has not reached the point the copy waits for
    event = store.copy_back(unit, after=gate)
    assert event is not None and store.ready(unit) is event
    return gate, event


@pytest.fixture
def discrete(monkeypatch):
    """The CPU device as a separate memory, so the store makes the copies a GPU needs (see accelerator.py)."""
    monkeypatch.setenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", "1")


def test_param_store_on_a_cpu_device_reads_in_place_and_copies_nothing(rooms):
    store, start = device_host_nvme(rooms)
    assert store.host_is_device and [store.in_place(u) for u, _ in UNITS] == [True, True, True, False]
    assert store.step_target(0) is store._shards[0].device  # the step writes the device home itself
    assert store.to_device(2, None) is store.host_copy(2)  # no copy stream needed: compute reads it there
    store.step_target(0).copy_(values(3000, 63).float())
    assert store.copy_back(0, after=None) is None and torch.equal(store.read(0), values(3000, 63).to(DTYPE))
    kept = rooms.param_store({0: Tier.DEVICE}, None, None, keep_host_copies=True)
    kept.add(0, "u0", start[0], host_copy=True)  # a step that can fail part way writes a copy of its own
    assert not kept.in_place(0) and kept.step_target(0) is not kept._shards[0].device


def test_param_store_copy_back_publishes_a_device_home_after_its_event(rooms, discrete):
    store, start = device_host_nvme(rooms)
    new = values(3000, 61).float()
    gate, event = gated_copy_back(rooms, store, 0, new)
    assert not event.query()
    assert torch.equal(store._shards[0].device, start[0].to(DTYPE))  # nothing published before the copy ran
    gate.open_after(0.2)
    out = store.to_device(0, None)  # the next reader waits for the copy's event
    assert event.query() and torch.equal(out, new.to(DTYPE))
    event.synchronize()
    assert torch.equal(store.read(0), new.to(DTYPE))
    assert store.copy_back(2, None) is None and store.copy_back(3, None) is None  # nothing to copy back for other homes


def test_param_store_read_of_a_device_home_waits_for_its_copy_back(rooms, discrete):
    store, _ = device_host_nvme(rooms)
    new = values(3000, 62).float()
    gate, _ = gated_copy_back(rooms, store, 0, new)
    gate.open_after(0.2)
    got = store.read(0).clone()
    assert torch.equal(got, new.to(DTYPE))


def test_param_store_nvme_step_commit_publishes_and_abort_discards(rooms):
    store, start = device_host_nvme(rooms)
    old = start[3].to(DTYPE)
    first, second = values(1000, 71), values(1000, 72)
    store.step_target(3).copy_(first)
    store.wrote(3)
    store.abort()
    assert torch.equal(store.read(3), old)
    store.step_target(3).copy_(second)
    store.wrote(3)
    assert torch.equal(store.read(3), old)  # not current before the commit
    store.commit()
    assert torch.equal(store.read(3), second)
    assert store.copy_back(3, after=None) is None


def test_param_store_nvme_failed_write_is_stale_until_overwritten(rooms):
    store, start = device_host_nvme(rooms)
    rooms.engine.fail("write", file=PARAMS)
    store.step_target(3).copy_(values(1000, 73))
    store.wrote(3)
    with pytest.raises(ParamSwapError):
        store.commit()
    assert store.stale() == {3}
    master = values(1000, 74, torch.float32)
    store.overwrite(3, master)
    assert store.stale() == set() and torch.equal(store.read(3), master.to(DTYPE))


def test_param_store_refuses_homes_that_do_not_match_the_swap(rooms):
    swap = rooms.param_swap([(1, 2500)])
    accel = rooms.accel()
    host = TierBudget(Tier.HOST, None)
    cases = [
        ({0: Tier.NVME, 1: Tier.HOST}, swap),  # the swap holds unit 1, the homes say unit 0
        ({0: Tier.NVME, 1: Tier.NVME}, swap),  # one NVMe unit more than the swap holds
        ({0: Tier.HOST, 1: Tier.HOST}, swap),  # a swap for no NVMe unit
        ({0: Tier.HOST, 1: Tier.NVME}, None),  # an NVMe home without a swap
    ]
    for homes, s in cases:
        with pytest.raises(ValueError, match="exactly the units homed on NVMe"):
            ParamStore(accel, DTYPE, homes, swap=s, host=host, telemetry=Telemetry())
    ParamStore(accel, DTYPE, {0: Tier.DEVICE, 1: Tier.NVME}, swap=swap, host=host, telemetry=Telemetry())


# ------------------------------------------------------------------ budgets

def param_needs(sizes=UNITS, buffer_count: int = 2) -> tuple[int, int]:
    """(NVMe, host) bytes a ParamSwap over ``sizes`` must take."""
    nvme = sum(2 * round_up(n * DTYPE.itemsize) for _, n in sizes)
    return nvme, param_buffer_bytes([n for _, n in sizes], DTYPE.itemsize, buffer_count)


def plan_config(param: str = "none", opt: str = "nvme", **budgets: int) -> Config:
    zero = {"stage": 3, "sub_group_size": 1000,
            "offload_optimizer": {"device": opt, "nvme_path": "/nvme", "buffer_count": 2},
            "offload_param": {"device": param, "nvme_path": "/nvme", "buffer_count": 2, "max_in_cpu": 0}}
    return Config.load({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
                        "offload": {"budgets": budgets}})


@pytest.mark.parametrize("tier", ["nvme", "host"])
def test_a_parameter_swap_over_budget_is_a_config_error_naming_it(tier):
    need = dict(zip(("nvme", "host"), param_needs()))
    placement = plan(Shards(list(UNITS), set(), DTYPE.itemsize), plan_config("nvme", "cpu", **{tier: need[tier] - 1}))
    assert placement.problems[0].path == f"offload.budgets.{tier}"  # the first: what initialize raises
    assert f"{need[tier] - 1:,} bytes cannot hold" in str(placement.problems[0])
    with pytest.raises(ConfigError, match=f"{need[tier] - 1:,} bytes cannot hold"):
        placement.check()
    fits = plan(Shards(list(UNITS), set(), DTYPE.itemsize), plan_config("nvme", "cpu", **{tier: need[tier]}))
    assert fits.problems == [] and fits.homes == {u: Tier.NVME for u, _ in UNITS}
    assert (fits.nvme["parameter shards (two slots per unit)"], fits.host["parameter NVMe buffers"]) == param_needs()


def test_param_swap_takes_exactly_the_bytes_it_reports(rooms):
    nvme_need, host_need = param_needs()
    assert host_need == (2 + WRITE_BUFFERS) * round_up(4100 * 2)
    nvme, host = TierBudget(Tier.NVME, 4096 + nvme_need, used=4096), TierBudget(Tier.HOST, 100 + host_need, used=100)
    swap = rooms.param_swap(nvme=nvme, host=host)
    assert nvme.used == nvme.limit and host.used == host.limit
    assert nvme.parts == {"parameter shards (two slots per unit)": nvme_need}
    assert host.parts == {"parameter NVMe buffers": host_need}
    assert os.path.getsize(rooms.file(PARAMS)) == nvme_need
    load(swap, shards(1))
    assert_current(swap, shards(1))


def opt_needs(buffer_count: int = 2) -> tuple[int, int]:
    """(NVMe, host buffers) bytes of OPT_UNITS in sub-groups of 1000 elements, all on NVMe."""
    nbytes = round_up(KINDS * 1000 * 4)
    return 4 * 2 * nbytes, min(buffer_count, 4) * nbytes


@pytest.mark.parametrize("device, tier", [("nvme", "nvme"), ("nvme", "host"), ("cpu", "host")])
def test_optimizer_state_over_budget_is_a_config_error_naming_it(device, tier):
    """The plan counts the gradient accumulators, parameter copies and staging buffers first (the host keeps
    them whatever happens), then places the sub-groups in what is left."""
    nvme_need, buffers = opt_needs()
    units = list(OPT_UNITS)
    reserved = sum(plan(Shards(units, {u for u, _ in units}, DTYPE.itemsize), plan_config(opt=device)).host.values())
    reserved -= {"nvme": buffers, "cpu": 4 * round_up(KINDS * 1000 * 4)}[device]
    need = {"nvme": nvme_need, "host": reserved + (buffers if device == "nvme" else 4 * round_up(KINDS * 1000 * 4))}
    limit = need[tier] - 1
    placement = plan(Shards(units, {u for u, _ in units}, DTYPE.itemsize), plan_config(opt=device, **{tier: limit}))
    assert placement.problems[0].path == f"offload.budgets.{tier}"  # the first: what initialize raises
    assert f"{limit:,} bytes cannot hold" in str(placement.problems[0])
    fits = plan(Shards(units, {u for u, _ in units}, DTYPE.itemsize), plan_config(opt=device, **{tier: need[tier]}))
    assert fits.problems == [] and fits.placed
    assert [g.tier for g in fits.groups] == [Tier.NVME if device == "nvme" else Tier.HOST] * 4


def test_optimizer_takes_exactly_the_bytes_it_reports(rooms):
    nvme_need, buffers = opt_needs()
    nvme, host = TierBudget(Tier.NVME, nvme_need), TierBudget(Tier.HOST, buffers)  # the host holds only the buffers
    store, state = built(rooms, buffer_count=2, nvme=nvme, host=host)
    assert [g.tier for g in store.groups] == [Tier.NVME] * 4
    assert nvme.used == nvme_need and host.used == buffers
    assert nvme.parts == {"optimizer state (two slots per sub-group)": nvme_need}
    assert host.parts == {"optimizer NVMe buffers": buffers}
    assert os.path.getsize(rooms.file(OPTIMIZER)) == nvme_need
    run_pass(store, 1)
    assert_state(store, stepped(state, 1))
    cpu = rooms.optimizer(OPT_UNITS, 1000, device="cpu", host=TierBudget(Tier.HOST, 4 * round_up(KINDS * 1000 * 4)))
    assert [g.tier for g in cpu.groups] == [Tier.HOST] * 4 and cpu.host.used == cpu.host.limit


@pytest.mark.parametrize("tier", list(Tier))
def test_going_over_a_budget_names_the_tier_as_text_says_it(tier):
    """The budget holds a Tier; its error names it by the tier's name ("host", not "Tier.HOST")."""
    budget = TierBudget(tier, 100)
    budget.take(60, "optimizer state")
    with pytest.raises(BudgetExceeded, match=rf"^{tier.value} budget of 100 bytes exceeded: parameter copies needs 50 "
                                             r"with 60 in use \(optimizer state 60\)$"):
        budget.take(50, "parameter copies")
    assert budget.summary() == {"optimizer state": 60, "total": 60, "peak": 60, "budget": 100}
