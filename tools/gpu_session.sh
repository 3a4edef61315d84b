#!/usr/bin/env bash
# On a lent GPU machine (no network; torch with CUDA already there): install offload from this
# checkout, then run the named stages, logging each to $OUT/<stage>.log.
#   tools/gpu_session.sh install cuda-tests suite bench-pcie bench-step
# Wheels/sdists the machine lacks (liburing 2024.5.3 and dynamic-import) travel in .whl/.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
PY=python3

stage() {  # name, command...: run one stage, log it, never stop the others
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}

install() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
  $PY -m pip install -q --no-index --no-build-isolation --no-deps .whl/* &&
  $PY -m pip install -q --no-index --no-build-isolation --no-deps -e . &&
  $PY -c "import offload, offload._native as n; from offload.aio import probe_io_uring; print('native', offload.native.active_variant()); print(probe_io_uring())"
}

for s in "$@"; do
  case "$s" in
    install) stage install install ;;
    cuda-tests) stage cuda-tests $PY -m pytest -q -x tests/test_engine_cuda.py tests/test_cli.py -k "cuda or gpu or pcie" ;;
    suite) FAIL_LOG=$OUT/failures.log PYTHONPATH=tools TAIL=30 stage suite timeout "${SUITE_S:-420}" $PY -m pytest -n 14 -q -p pytest_failures_now -p no:cacheprovider -p no:benchmark --timeout 150 ${SUITE_ARGS:-tests} ;;
    bench-pcie) stage bench-pcie $PY -m offload bench pcie --out "$OUT/pcie.json" ;;
    bench-step) stage bench-step $PY -m offload bench step --device cuda --world 1 --dtype bf16 --hidden 1024 \
      --layers 12 --seq 512 --micro 8 --steps 4 --rounds 2 --out "$OUT/step.json" ;;
    *) echo "unknown stage $s" ;;
  esac
done
