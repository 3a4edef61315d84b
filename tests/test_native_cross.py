"""The NEON kernels, on an x86 machine: cross-compiled with the flags CMakeLists.txt gives the neon variant and run
under qemu-user against the portable kernels (tests/native/kernel_variants.cpp). Python's own kernel tests cover
every variant the machine itself runs; this covers the one it cannot."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CXX, QEMU = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")


def variant_flags(name: str) -> list[str]:
    """The compile options CMakeLists.txt passes for one kernel variant, besides the common ones."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(rf"offload_kernel_variant\({name}\b([^)]*)\)", cmake)
    assert match, f"CMakeLists.txt builds no {name} variant"
    return match.group(1).split()


def build_kernel_check(cxx: str, names: list[str], out: Path, link: list[str]) -> Path:
    """tests/native/kernel_variants.cpp linked with kernels.cpp built once per variant in ``names`` (the first is
    "portable"), each with the flags CMakeLists.txt gives it."""
    common = [cxx, "-std=c++17", "-O3", "-ffp-contract=off", f"-I{ROOT / 'native'}"]
    objects = []
    for name in names:
        obj = out / f"{name}.o"
        flags = variant_flags(name)
        subprocess.run([*common, *flags, f"-DOFFLOAD_ISA_NAME={name}", "-c", str(ROOT / "native" / "kernels.cpp"),
                        "-o", str(obj)], check=True)
        objects.append(str(obj))
    exe = out / "kernel_variants"
    defines = [f"-DOFFLOAD_HAVE_{name.upper()}=1" for name in names[1:]]
    subprocess.run([*common, *defines, str(ROOT / "tests" / "native" / "kernel_variants.cpp"), *objects, *link,
                    "-o", str(exe)], check=True)
    return exe


@pytest.mark.skipif(CXX is None or QEMU is None, reason="needs g++-aarch64-linux-gnu and qemu-user (./dev.sh test "
                                                         "installs them where apt-get can)")
def test_neon_kernels_equal_the_portable_ones_under_qemu(tmp_path):
    exe = build_kernel_check(CXX, ["portable", "neon"], tmp_path, ["-static"])
    run = subprocess.run([QEMU, str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "ok: 1 variant(s) equal the portable kernels" in run.stdout


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@pytest.mark.skipif(shutil.which("g++") is None or "avx2" not in _cpu_flags(), reason="needs g++ and an AVX2 CPU")
def test_x86_kernels_equal_the_portable_ones(tmp_path):
    """The same check for the x86 variants this CPU runs, built with CMakeLists.txt's flags (the Python tests compare
    each with torch; this compares them with the portable kernels bit for bit, landed gradients included)."""
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= _cpu_flags()
    names = ["portable", "avx2"] + (["avx512"] if avx512 else []) + (
        ["avx512bf16"] if avx512 and "avx512_bf16" in _cpu_flags() else [])
    exe = build_kernel_check("g++", names, tmp_path, [])
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"ok: {len(names) - 1} variant(s) equal the portable kernels" in run.stdout
