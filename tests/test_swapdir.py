"""Swap directories: one run each, space reserved up front, leftovers reported, never shared."""

import errno
import fcntl
import logging
import os
import subprocess
import sys
import uuid

import pytest
import torch

from offload.aio import AlignedBuffer, SwapIOError, make_engine
from offload.store import SwapDir, SwapDirError, find_leftovers
from offload.store.swapdir import Owner


def test_reserve_write_read_and_clean_exit(tmp_path):
    with SwapDir(tmp_path) as d, make_engine("auto", block_size=1 << 20) as eng:
        f = d.reserve("master.bin", 3 * (1 << 20) + 5)
        assert os.path.getsize(f.path) == 3 * (1 << 20) + 4096
        assert os.stat(f.path).st_blocks * 512 >= 3 * (1 << 20)  # blocks really allocated
        buf = AlignedBuffer(1 << 20)
        buf.tensor.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
        eng.write(f, buf.tensor, 1 << 20, 1 << 20).wait()
        back = AlignedBuffer(1 << 20)
        eng.read(f, back.tensor, 1 << 20, 1 << 20).wait()
        assert torch.equal(back.tensor, buf.tensor)
        path = d.path
        assert path.parent == tmp_path and path.name.startswith("offload-swap-")
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_two_users_of_one_directory_are_refused(tmp_path):
    with SwapDir(tmp_path, name="shared"):
        with pytest.raises(SwapDirError, match=r"shared is in use by pid \d+ on .*; two runs must not share"):
            SwapDir(tmp_path, name="shared")


def test_another_ranks_scan_while_a_directory_is_made_finds_no_leftover_and_takes_no_lock(tmp_path, monkeypatch):
    """[Note: a swap directory appears locked]: ranks share nvme_path; a scan at the moment the maker takes its lock
    took the lock itself before, and the maker failed with 'in use by another process' (seen in CI)."""
    import offload.store.swapdir as swapdir
    seen = []
    real_flock = fcntl.flock

    def scan_then_flock(fd, op):  # another rank's start-up scan, at the worst moment
        seen.append([str(x.path) for x in find_leftovers(tmp_path)])
        return real_flock(fd, op)

    monkeypatch.setattr(swapdir.fcntl, "flock", scan_then_flock)
    with SwapDir(tmp_path, name="offload-swap-rank1") as d:
        assert seen and all(found == [] for found in seen), seen
        assert swapdir.Owner.parse((d.path / "LOCK").read_text()).pid == os.getpid()
        assert [p.name for p in tmp_path.iterdir()] == ["offload-swap-rank1"]  # no staging directory stays


def test_a_killed_runs_directory_is_reclaimed_at_the_next_start_and_the_log_says_what_and_how_much(tmp_path,
                                                                                                      caplog):
    code = ("import os, sys; from offload.store import SwapDir; d = SwapDir(sys.argv[1]); "
            "d.reserve('state.bin', 3 << 20); print(d.path, flush=True); os._exit(9)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    left_path = proc.stdout.strip()
    leftovers = find_leftovers(tmp_path)
    assert [str(x.path) for x in leftovers] == [left_path] and leftovers[0].bytes >= 3 << 20
    assert leftovers[0].dead() == f"pid {leftovers[0].owner.pid} on this host is gone"
    with caplog.at_level(logging.WARNING, logger="offload.store"), SwapDir(tmp_path):
        pass
    assert f"removed {left_path} (3.1 MB), left by a run that was killed: pid" in caplog.text
    assert not os.path.exists(left_path)


def _leftover(root, lock_text):
    d = root / "offload-swap-elsewhere"
    d.mkdir()
    (d / "LOCK").write_text(lock_text)
    (d / "state.bin").write_bytes(b"x" * (2900 - len(lock_text)))  # 2.9 kB with the LOCK
    return d


@pytest.mark.parametrize("whose", ["another host", "a live process", "an older offload's lock"])
def test_a_leftover_whose_writer_may_live_is_kept_with_a_warning_in_units_that_show_it(tmp_path, caplog, whose):
    me = Owner.me()
    text = {"another host": Owner(me.pid + 1, "some-other-host", 1, me.boot).line(),
            "a live process": me.line(),  # its lock is free, but the process that wrote it runs
            "an older offload's lock": f"pid 999999 on {me.host}\n"}[whose]
    left = _leftover(tmp_path, text)
    with caplog.at_level(logging.WARNING, logger="offload.store"), SwapDir(tmp_path):
        pass
    assert left.is_dir() and f"{left} (2.9 kB) is left over" in caplog.text and "rm -r" in caplog.text


def test_a_leftover_from_before_a_reboot_or_of_a_reused_pid_is_reclaimed(tmp_path):
    me = Owner.me()
    rebooted = _leftover(tmp_path, Owner(me.pid, me.host, me.start, "another-boot").line())
    assert find_leftovers(tmp_path)[0].dead() == f"the machine has rebooted since pid {me.pid} wrote it"
    rebooted.rename(tmp_path / "offload-swap-x")
    reused = Owner(me.pid, me.host, (me.start or 0) + 1, me.boot)
    (tmp_path / "offload-swap-x" / "LOCK").write_text(reused.line())
    assert find_leftovers(tmp_path)[0].dead() == f"pid {me.pid} is now another process"
    with SwapDir(tmp_path):
        assert not (tmp_path / "offload-swap-x").exists()


def test_a_run_that_never_closes_its_engine_removes_its_swap_files_at_exit_and_a_fork_does_not(tmp_path):
    """A script whose last line is its last step (no engine.close()) ends cleanly: its swap directory goes with
    it, so the next run finds no leftover; a forked child that exits leaves its parent's live directory alone."""
    code = ("import os, sys, offload, torch; from engine_cases import base_config, make_model\n"
            "config = base_config(2, 1, 1, offload_optimizer={'device': 'nvme', 'nvme_path': sys.argv[1]})\n"
            "engine, *_ = offload.initialize(model=make_model('gpt'), config=config)\n"
            "swap = next(p for p in os.listdir(sys.argv[1]) if p.startswith('offload-swap-'))\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    sys.exit(0)  # a forked child's normal exit runs its atexit hooks\n"
            "os.waitpid(pid, 0)\n"
            "assert os.path.isdir(os.path.join(sys.argv[1], swap)), 'the child removed the live directory'\n"
            "tokens = torch.randint(0, 64, (2, 17))\n"
            "engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))\n"
            "engine.step()\n"
            "print(swap)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("offload-swap-")
    assert list(tmp_path.iterdir()) == [] and find_leftovers(tmp_path) == []


def test_a_live_run_is_not_reported_as_a_leftover(tmp_path):
    with SwapDir(tmp_path) as d:
        d.reserve("x.bin", 4096)
        assert find_leftovers(tmp_path) == []


def test_unwritable_nvme_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SwapDirError, match=r"cannot create nvme_path .*file/swap.*point nvme_path at a writable"):
        SwapDir(blocker / "swap")


def test_reserving_more_than_the_disk_holds_fails_at_start_with_numbers(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    with SwapDir(tmp_path) as d:
        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(SwapIOError, match=r"no space left: 8,192 bytes needed, [\d,]+ free") as e:
            d.reserve("big.bin", 8000)
        assert e.value.errno == errno.ENOSPC
        assert not (d.path / "big.bin").exists()


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 1 MiB file system (tmpfs), where the machine lets us mount one."""
    mnt = tmp_path / f"tiny-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (covered by the injected ENOSPC test)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_real_full_disk_keeps_earlier_files_intact(tiny_fs):
    with SwapDir(tiny_fs) as d, make_engine("auto", block_size=64 << 10) as eng:
        f = d.reserve("a.bin", 256 << 10)
        data = AlignedBuffer(256 << 10)
        data.tensor.copy_(torch.randint(0, 256, (256 << 10,), dtype=torch.uint8))
        eng.write(f, data.tensor, 0, 256 << 10).wait()
        with pytest.raises(SwapIOError, match="no space left"):
            d.reserve("b.bin", 4 << 20)
        back = AlignedBuffer(256 << 10)
        eng.read(f, back.tensor, 0, 256 << 10).wait()
        assert torch.equal(back.tensor, data.tensor)
