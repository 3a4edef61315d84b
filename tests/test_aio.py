"""Swap I/O engines: round trips, tails, concurrency, and faults that must never pass as success."""

import errno
import os
import subprocess
import sys

import pytest
import torch

from offload.aio import (
    AlignedBuffer,
    BufferPool,
    PoolExhausted,
    SwapFile,
    SwapIOError,
    make_engine,
    probe_io_uring,
    round_up,
)
from offload.aio.base import Piece

ENGINES = ["threads"] + (["io_uring"] if probe_io_uring().ok else [])


@pytest.fixture(params=ENGINES)
def engine(request):
    with make_engine(request.param, block_size=64 << 10, queue_depth=4, threads=2) as eng:
        yield eng


@pytest.fixture
def swap(tmp_path):
    with SwapFile.open(tmp_path / "swap.bin") as f:
        yield f


def random_buffer(n: int, seed: int) -> AlignedBuffer:
    buf = AlignedBuffer(n)
    gen = torch.Generator().manual_seed(seed)
    buf.tensor[:] = torch.randint(0, 256, (buf.capacity,), generator=gen, dtype=torch.uint8)
    return buf


def test_io_uring_is_available_on_this_machine_class():
    # CI machines allow io_uring; if this fails the engine silently fell back and the tests above
    # covered only the thread pool.
    assert probe_io_uring().ok, probe_io_uring().reason


@pytest.mark.parametrize("length", [1, 4095, 4096, 4097, 65536, 65536 * 3 + 17, 1 << 20])
@pytest.mark.parametrize("offset", [0, 4096, 3 * 65536])
def test_round_trip_any_length_and_offset(engine, swap, length, offset):
    src, dst = random_buffer(length, length), AlignedBuffer(length)
    engine.write(swap, src.tensor, offset, length).wait()
    engine.read(swap, dst.tensor, offset, length).wait()
    assert torch.equal(dst.tensor[:length], src.tensor[:length])


def test_many_concurrent_requests_land_in_their_places(engine, swap):
    n, count = 40_000, 24
    bufs = [random_buffer(n, i) for i in range(count)]
    slot = round_up(n)
    engine.wait_all([engine.write(swap, b.tensor, i * slot, n) for i, b in enumerate(bufs)])
    outs = [AlignedBuffer(n) for _ in range(count)]
    engine.wait_all([engine.read(swap, o.tensor, i * slot, n) for i, o in enumerate(outs)])
    for b, o in zip(bufs, outs):
        assert torch.equal(b.tensor[:n], o.tensor[:n])


def test_typed_views_round_trip(engine, swap):
    buf = AlignedBuffer(1000 * 4)
    x = buf.view(torch.float32, 1000)
    x.copy_(torch.randn(1000))
    engine.write(swap, buf.tensor, 0, 4000).wait()
    back = AlignedBuffer(4000)
    engine.read(swap, back.tensor, 0, 4000).wait()
    assert torch.equal(back.view(torch.float32, 1000), x)


def test_reading_past_the_end_is_an_error_not_garbage(engine, swap):
    src = random_buffer(8192, 1)
    engine.write(swap, src.tensor, 0, 8192).wait()
    dst = AlignedBuffer(64 << 10)
    with pytest.raises(SwapIOError, match=r"in .*swap\.bin failed: short read: the file ends here") as e:
        engine.read(swap, dst.tensor, 0, 64 << 10).wait()
    assert e.value.errno == errno.EIO and e.value.offset == 8192


def test_misaligned_requests_are_refused_with_the_fix(engine, swap):
    raw = torch.empty(10_000, dtype=torch.uint8)
    unaligned = raw[1:]
    with pytest.raises(ValueError, match="4096-aligned buffer addresses and file offsets"):
        engine.write(swap, unaligned, 0, 4096)
    buf = AlignedBuffer(8192)
    with pytest.raises(ValueError, match="offset = 100"):
        engine.write(swap, buf.tensor, 100, 4096)
    with pytest.raises(ValueError, match="buffer holds 8,192"):
        engine.write(swap, buf.tensor, 0, 8193)


def test_read_only_file_refuses_writes(engine, tmp_path):
    path = tmp_path / "ro.bin"
    path.write_bytes(b"\0" * 8192)
    with SwapFile.open(path, writable=False) as f, pytest.raises(ValueError, match="opened read-only"):
        engine.write(f, AlignedBuffer(4096).tensor, 0, 4096)


def test_open_errors_name_the_path(tmp_path):
    with pytest.raises(SwapIOError, match=r"open of 0 bytes .* in .*missing/dir/x\.bin failed: No such file"):
        SwapFile.open(tmp_path / "missing" / "dir" / "x.bin")


# ------------------------------------------------------------------ injected faults

class Faults:
    """Replaces os.preadv/os.pwritev (thread engine) or the completion result (io_uring) for chosen pieces."""

    def __init__(self, monkeypatch, engine, mode: str, at_piece: int = 1):
        self.mode, self.at, self.count = mode, at_piece, 0
        if engine.name == "io_uring":
            engine._inject = self._uring
        else:
            import offload.aio.base as base
            real_p, real_w = os.preadv, os.pwritev
            monkeypatch.setattr(base.os, "preadv", lambda fd, bufs, off: self._sys(real_p, fd, bufs, off))
            monkeypatch.setattr(base.os, "pwritev", lambda fd, bufs, off: self._sys(real_w, fd, bufs, off))

    def _hit(self) -> bool:
        self.count += 1
        return self.count == self.at + 1

    def _sys(self, real, fd, bufs, off):
        if self._hit():
            if self.mode == "eio":
                raise OSError(errno.EIO, "Input/output error")
            if self.mode == "enospc":
                raise OSError(errno.ENOSPC, "No space left on device")
            if self.mode == "short":
                mv = bufs[0]
                return real(fd, [mv[: len(mv) // 2 // 4096 * 4096 or 4096]], off)
        return real(fd, bufs, off)

    def _uring(self, piece: Piece, res: int) -> int:
        if self._hit():
            if self.mode == "eio":
                return -errno.EIO
            if self.mode == "enospc":
                return -errno.ENOSPC
            if self.mode == "short" and res > 4096:
                # Pretend only the first half arrived: the engine must fetch the rest.
                return res // 2 // 4096 * 4096
        return res


def test_short_transfers_are_continued(engine, swap, monkeypatch):
    n = 256 << 10
    src = random_buffer(n, 3)
    Faults(monkeypatch, engine, "short", at_piece=1)
    engine.write(swap, src.tensor, 0, n).wait()
    dst = AlignedBuffer(n)
    Faults(monkeypatch, engine, "short", at_piece=2)
    engine.read(swap, dst.tensor, 0, n).wait()
    assert torch.equal(dst.tensor, src.tensor)


@pytest.mark.parametrize("mode, err", [("eio", errno.EIO), ("enospc", errno.ENOSPC)])
def test_failed_write_names_file_offset_length_errno_and_keeps_earlier_data(engine, swap, monkeypatch, mode, err):
    first = random_buffer(64 << 10, 4)
    engine.write(swap, first.tensor, 0, 64 << 10).wait()
    second = random_buffer(256 << 10, 5)
    Faults(monkeypatch, engine, mode, at_piece=2)
    with pytest.raises(SwapIOError) as e:
        engine.write(swap, second.tensor, 1 << 20, 256 << 10).wait()
    assert e.value.errno == err and "swap.bin" in str(e.value) and "write of" in str(e.value)
    assert e.value.offset >= 1 << 20 and e.value.length > 0
    back = AlignedBuffer(64 << 10)
    monkeypatch.undo()
    if engine.name == "io_uring":
        engine._inject = None
    engine.read(swap, back.tensor, 0, 64 << 10).wait()
    assert torch.equal(back.tensor, first.tensor)


def test_failed_read_waits_for_the_rest_then_raises(engine, swap, monkeypatch):
    n = 512 << 10
    engine.write(swap, random_buffer(n, 6).tensor, 0, n).wait()
    Faults(monkeypatch, engine, "eio", at_piece=3)
    req = engine.read(swap, AlignedBuffer(n).tensor, 0, n)
    with pytest.raises(SwapIOError, match=r"read of .* failed: Input/output error \[errno 5 EIO\]"):
        req.wait(timeout=60)
    assert req.done()


# ------------------------------------------------------------------ buffers and pool

def test_aligned_buffer_is_page_aligned_and_rounded():
    buf = AlignedBuffer(10_000)
    assert buf.address % 4096 == 0 and buf.capacity == 12_288 and buf.tensor.numel() == 12_288
    assert buf.pinned is False or torch.cuda.is_available()


class _Driver:
    """Stands in for the CUDA runtime's host registrations (this machine has no GPU): like the driver, it refuses
    to register an address range that overlaps one still registered (error 712)."""

    def __init__(self):
        self.registered: dict[int, int] = {}
        self.unknown = 0  # unregistrations of addresses not registered

    def cudaHostRegister(self, address, nbytes, flags):
        if any(a < address + nbytes and address < a + n for a, n in self.registered.items()):
            return 712
        self.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address):
        if self.registered.pop(address, None) is None:
            self.unknown += 1
            return 713
        return 0


def test_a_pinned_buffer_gives_its_registration_back_when_its_last_view_is_dropped(monkeypatch):
    driver = _Driver()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: driver)
    views = []
    for _ in range(8):  # freed mappings are reused at the same addresses: a stale registration would fail one
        buf = AlignedBuffer(3 * 4096, pin=True)
        views.append(buf.view(torch.float32, 10))
        assert buf.pinned and buf.address in driver.registered
        del buf
        assert len(driver.registered) == 1  # the view keeps the pages mapped, so they stay registered
        views.clear()
        assert driver.registered == {}
    released = AlignedBuffer(4096, pin=True)
    released.release_pin()
    assert driver.registered == {} and not released.pinned
    del released
    assert driver.unknown == 0  # given back once, not twice


def test_pool_never_grows_past_its_budget_and_says_so():
    pool = BufferPool(3 * 4096, name="test pool")
    a, b = pool.acquire(4096), pool.acquire(8000)
    with pytest.raises(PoolExhausted, match=r"test pool: 4,096 more bytes would exceed its budget of 12,288"):
        pool.acquire(1)
    pool.release(a)
    c = pool.acquire(100)  # reuses a's block
    assert c is a
    assert pool.stats().in_use == 3 * 4096 and pool.stats().peak == 3 * 4096
    pool.release(b)
    pool.release(c)
    big = pool.acquire(3 * 4096)  # cached blocks of other sizes are dropped to make room
    assert big.capacity == 3 * 4096 and pool.stats().buffers_out == 1


def test_engine_choice():
    with pytest.raises(ValueError, match="'auto', 'io_uring' or 'threads'"):
        make_engine("spdk")
    with make_engine("threads") as eng:
        assert eng.name == "threads"


def test_tune_nvme_quick_end_to_end_fragment_loads_into_a_config(tmp_path, capsys):
    from offload.aio import engine_from_config
    from offload.commands.cli import main
    from offload.config import Config
    out = tmp_path / "tuned"
    assert main(["tune-nvme", "--path", str(tmp_path / "drive"), "--quick", "--file-size", "16Mi", "--no-fio",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "best:" in printed and "read GB/s" in printed
    import json
    fragment = json.loads((out / "aio_fragment.json").read_text())
    results = json.loads((out / "results.json").read_text())
    assert len(results) == (8 if probe_io_uring().ok else 4)
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = Config.load({**json.loads((__import__("conftest").REPO / "configs/zero3_nvme_offload.json").read_text()),
                       **fragment})
    assert cfg.aio.block_size == fragment["aio"]["block_size"]
    assert cfg.offload.aio_engine == fragment["offload"]["aio_engine"]
    with engine_from_config(cfg) as eng:
        assert eng.name == fragment["offload"]["aio_engine"]
    assert list((tmp_path / "drive").iterdir()) == []  # scratch files removed


# ------------------------------------------------------------------ checksums

def test_crc32c_matches_the_standard_check_value_on_every_variant(variant):
    from offload.machine import native
    data = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert int(native.crc32c_blocks(data, 9)[0]) == 0xE3069283
    big = torch.randint(0, 256, (3 * (1 << 20) + 5,), dtype=torch.uint8)
    per_block = native.crc32c_blocks(big, 1 << 20, threads=2)
    assert len(per_block) == 4
    import zlib  # not CRC-32C, but proves blocks are independent: equal blocks give equal CRCs
    big[: 1 << 20] = big[1 << 20: 2 << 20]
    again = native.crc32c_blocks(big, 1 << 20, threads=2)
    assert again[0] == again[1] == per_block[1] and zlib.crc32(b"") == 0


@pytest.mark.parametrize("length", [4096, 300_001, 1 << 20])
def test_checksummed_round_trip(engine, swap, length):
    from offload.aio import ChecksummedFile
    src, dst = random_buffer(length, 11), AlignedBuffer(length)
    with ChecksummedFile(engine, swap) as cf:
        cf.write(src.tensor, 8192, length).wait()
        cf.read(dst.tensor, 8192, length).wait()
    assert torch.equal(dst.tensor[:length], src.tensor[:length])


def test_a_flipped_byte_in_a_swap_file_is_caught(engine, swap):
    from offload.aio import ChecksumError, ChecksummedFile
    cf = ChecksummedFile(engine, swap)
    n = 300_000
    cf.write(random_buffer(n, 12).tensor, 0, n).wait()
    with open(swap.path, "r+b") as f:  # corrupt one byte behind the engine's back
        f.seek(200_000)
        byte = f.read(1)
        f.seek(200_000)
        f.write(bytes([byte[0] ^ 0x20]))
    with pytest.raises(ChecksumError, match=r"at offset 196,608 in .*swap\.bin failed: checksum mismatch"):
        cf.read(AlignedBuffer(n).tensor, 0, n).wait()
    with pytest.raises(ValueError, match="no checksums recorded"):
        cf.read(AlignedBuffer(n).tensor, 4096, n)


def test_the_pinned_liburing_is_what_is_installed():
    from importlib.metadata import version
    assert version("liburing") == "2024.5.3"  # the 2026 wheels SIGILL on AVX2-only CPUs


def test_processes_importing_liburing_at_once_all_succeed():
    # liburing rewrites a cache file on import; unlocked, about one import in twenty failed here when six ran at once.
    code = "from offload.aio.liburing_probe import import_liburing; import_liburing()"
    procs = [subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True) for _ in range(8)]
    failures = [p.stderr.read() for p in procs if p.wait(timeout=120) != 0]
    assert failures == []


@pytest.mark.parametrize("length", [1, 7, 8, 25, 12287, 12288, 12289, 12295, 100_003])
def test_crc32c_of_every_length_equals_the_bitwise_definition(variant, length):
    """Long blocks run as three CRC lanes joined afterwards (see [Note: three CRC lanes]); every split point,
    remainder and tail must give the CRC the definition does."""
    from offload.machine import native

    def bitwise(data: bytes) -> int:
        c = 0xFFFFFFFF
        for byte in data:
            c ^= byte
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 & -(c & 1))
        return c ^ 0xFFFFFFFF

    data = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(length))
    assert int(native.crc32c_blocks(data, length)[0]) == bitwise(bytes(data.numpy()))
