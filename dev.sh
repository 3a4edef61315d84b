#!/usr/bin/env bash
# One entry point for the README's two commands (and CI):
#   ./dev.sh train [args]  set up .venv, then run the main job (offload train) on its embedded default
#   ./dev.sh demo [args]   the smaller walk-through of the engine (offload demo)
#   ./dev.sh test [args]   set up .venv, then run the whole test suite on three workers (args go to pytest)
#   ./dev.sh deepspeed     install DeepSpeed beside the venv's torch (for `offload bench step --baseline
#                          deepspeed`) and run the tests that need it: the side-by-side, and offload.hf's
#                          "auto" resolution against transformers' own (which imports DeepSpeed)
# Needs only Python >= 3.10 with pip and venv, and a C++ compiler; everything else comes from PyPI
# (and, for the NEON kernels' test, an aarch64 cross compiler and qemu-user from apt-get where it runs).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=${OFFLOAD_VENV:-.venv}
# torch first, pinned to a CPU-capable release: an unpinned torch makes pip fetch a multi-GB
# CUDA build. Set OFFLOAD_TORCH to the spec you want (e.g. the one your GPU machine has).
TORCH_SPEC=${OFFLOAD_TORCH:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "== installing $TORCH_SPEC"
  "$PY" -m pip install --disable-pip-version-check -q "$TORCH_SPEC"
fi

# Reinstall (and so rebuild native/) only when the build inputs changed. The editable install maps each module
# to its file, so the list of the package's files is an input too (a module added, moved or removed).
stamp="$VENV/.offload-build-stamp"
digest=$({ cat pyproject.toml CMakeLists.txt native/*; find offload -name '*.py' | LC_ALL=C sort; } |
  "$PY" -c "import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())")
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$digest" ] || ! "$PY" -c "import offload._native" 2>/dev/null; then
  echo "== installing offload (builds the native kernels; the first run also builds liburing, about a minute)"
  "$PY" -m pip install --disable-pip-version-check -q -e ".[test]"
  echo "$digest" > "$stamp"
fi

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  train)
    exec "$VENV/bin/offload" train "$@" ;;
  demo)
    exec "$VENV/bin/offload" demo "$@" ;;
  test)
    # The NEON kernels are checked on x86 too: cross-compiled and run under qemu-user
    # (tests/test_native_cross.py). Where apt-get can bring the tools, bring them; else that test skips.
    if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "== installing g++-aarch64-linux-gnu and qemu-user (the NEON kernels' test)"
        { apt-get install -y -q g++-aarch64-linux-gnu qemu-user >/dev/null 2>&1 ||
          { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q g++-aarch64-linux-gnu qemu-user >/dev/null 2>&1; }; } ||
          echo "   could not install them: the NEON test will be skipped"
      fi
    fi
    set +e
    # Three workers (pytest-xdist) on these 2-core boxes: part of the suite waits on subprocesses, ranks and emulated
    # copies (one worker to two: 16.5 -> 12.8 min, 2026-11-27; two to three on the AVX2 EPYC: 17:24 -> 16:04, the
    # inner loop 2:49 -> 2:38, 2026-12-07; unmeasured on the others). OFFLOAD_TEST_WORKERS=0 runs it in one process.
    # Each computes on one intra-op thread (tests/conftest.py sets OMP_NUM_THREADS): with three on two cores, a
    # team of two spins against the other workers (18:00 -> 13:50 on the AVX2 EPYC, 2026-12-07).
    # Whole files to a worker as it frees up, the longest first (tests/conftest.py orders them from tests/slow.txt).
    "$PY" -m pytest -n "${OFFLOAD_TEST_WORKERS:-3}" --dist loadfile "$@"
    rc=$?
    if [ $rc -eq 5 ]; then echo "pytest collected no tests: that is a failure" >&2; exit 1; fi
    exit $rc ;;
  deepspeed)
    # DeepSpeed's own requirements minus torch (keeping the torch installed above), its pure-Python package
    # without its ops (they build by JIT on first use: cpu_adam about 80 s here), and libaio's headers for its
    # NVMe (async_io) op where apt-get can bring them.
    if [ ! -e /usr/include/libaio.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "== installing libaio-dev (DeepSpeed's async_io op)"
      apt-get install -y -q libaio-dev >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libaio-dev >/dev/null 2>&1; } ||
        echo "   could not install it: DeepSpeed's NVMe variant will not run"
    fi
    echo "== installing DeepSpeed (no deps) and its requirements but torch"
    DS_BUILD_OPS=0 "$PY" -m pip install --disable-pip-version-check -q --no-deps "${DEEPSPEED_SPEC:-deepspeed==0.19.8}"
    "$PY" -m pip install --disable-pip-version-check -q einops hjson msgpack ninja py-cpuinfo "pydantic>=2" tqdm
    exec "$PY" -m pytest -q tests/test_bench_versus.py tests/test_hf_trainer.py tests/test_deepspeed_battery.py \
      tests/test_config_load.py tests/test_trl.py tests/test_accelerate.py \
      -k "versus or hugging_faces_own or battery or deepspeed or default" "$@" ;;
  *)
    echo "usage: ./dev.sh train|demo|test|deepspeed [args]" >&2; exit 64 ;;
esac
