#!/usr/bin/env bash
# Every GPU measurement and test the open issues name, in stages, each logged to $OUT/<stage>.log.
#
# Here (with network), once: build the wheels the lent machine lacks into .whl/ (git ignores it; it travels with
# the working tree as `carry: [".whl"]`, about 10 MiB):
#   tools/gpu_session.sh wheels
# On the lent GPU machine (no network; torch with CUDA already there), three back-to-back calls of the run tool, each
# with OUT pointed at a folder of its own and that folder tarred into the tool's $OUT at the end (the tool brings
# back at most 8 files); on the H100 on 2026-11-24 they took 320, 350 and over 470 s (2026-11-25: the first
# call with bench-step-placement instead of bench-pcie, bench-adam, bench-step: 329 s; bench-deepspeed,
# bench-deepspeed-placements and bench-step-1p3b: 498 s; profile and sanitizer: 57 s):
#   tools/gpu_session.sh install cuda-tests bench-pcie bench-adam bench-step bench-step-default
#   tools/gpu_session.sh bench-step-1p3b profile bench-deepspeed sanitizer
#   tools/gpu_session.sh bench-step-placement bench-deepspeed-placements (the speculative step,
#   offload_optimizer.ratio, the delayed update, DeepSpeed's other placements; 149 and 232 s on 2026-11-25)
#   tools/gpu_session.sh bench-step-1p3b-auto bench-step-delayed
#   tools/gpu_session.sh suite
# What the next GPU session should run first (not yet measured there: torch's fused Adam for state on the GPU, the
# all-on-GPU DeepSpeed variant after its arch-list fix, the 1.3B auto split's second round, device-homed units read
# where they live at W = 1 (no gathers: the 1.3B model re-gathered ~500 units a step); then the 156M steps):
#   tools/gpu_session.sh install cuda-tests bench-step-1p3b-auto bench-deepspeed-placements
#   tools/gpu_session.sh bench-step-placement bench-step-default bench-hooks sanitizer
#   tools/gpu_session.sh bench-step-1p3b-split bench-deepspeed-1p3b bench-step-nvme (the auto split under a device
#   budget the state does not fit; DeepSpeed on the 1.3B model; params and optimizer state on the lent machine's disk)
#   tools/gpu_session.sh bench-step-4p5b (alone: a model whose state does not fit on the GPU, auto beside all on host)
#   tools/gpu_session.sh bench-step-nvme-early (the optimizer state's NVMe pass, and the parameters' NVMe writes,
#   after step() returned: early_step on)
# Then replay the same model's recorded schedule here (`offload bench schedule`, docs/performance.md) and put the
# prediction beside what was measured.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
PY=${PY:-python3}
# The 155.8M GPT of the first H100 run (docs/performance.md): 12 x 1024, vocabulary 4096, seq 512, micro-batch 8.
M156=(--device cuda --world 1 --dtype bf16 --hidden 1024 --layers 12 --seq 512 --vocab 4096 --micro 8)
# A 1.3B GPT (24 x 2048, GPT-2's vocabulary) at seq 2048, accumulation 4, clipping on: plain PyTorch fits there.
M1P3B=(--device cuda --world 1 --dtype bf16 --hidden 2048 --layers 24 --seq 2048 --vocab 50304 --micro 1 --accum 4)

# A 4.5B GPT (28 x 3584): its optimizer state and gradients (about 72 GB with the bf16 parameters) do not fit on an
# 80 GB GPU beside its activations, nor does plain PyTorch (the bench then says so and compares the variants alone).
M4P5B=(--device cuda --world 1 --dtype bf16 --hidden 3584 --layers 28 --seq 2048 --vocab 50304 --micro 1)

stage() {  # name, command...: run one stage, log it, never stop the others
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}

wheels() {  # here: what the lent machine (Python 3.12, no network) lacks. liburing 2024.5.3 has no binary wheels
  # (the 2026 ones die on AVX2-only CPUs), so its sdist travels and builds there (Cython and setuptools are in its
  # image); DeepSpeed as a pure-Python wheel without its ops; its requirements that image lacks, as 3.12 wheels.
  rm -rf .whl && mkdir -p .whl &&
  $PY -m pip download -q --no-deps --no-binary=:all: -d .whl "liburing==2024.5.3" &&
  $PY -m pip wheel -q --no-deps -w .whl dynamic-import &&
  DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps -w .whl "${DEEPSPEED_SPEC:-deepspeed==0.19.8}" &&
  $PY -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl hjson "pydantic>=2" &&
  du -sh .whl && ls .whl
}

install() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
  $PY -m pip install -q --no-index --no-build-isolation --no-deps .whl/liburing-*.tar.gz .whl/dynamic_import-* &&
  $PY -m pip install -q --no-index --no-build-isolation --no-deps -e . &&
  $PY -c "import offload, offload._native as n; from offload.aio import probe_io_uring; print('native', offload.native.active_variant()); print(probe_io_uring())" &&
  if ls .whl/deepspeed-* >/dev/null 2>&1; then
    # DeepSpeed and what it needs beside torch; its cpu_adam op builds by JIT on first use (bench-deepspeed).
    $PY -m pip install -q --no-index --find-links .whl .whl/deepspeed-* && $PY -c "import deepspeed; print('deepspeed', deepspeed.__version__)"
  fi
}

deepspeed_side_by_side() {
  if ! $PY -c "import deepspeed" 2>/dev/null; then echo "DeepSpeed is not installed here (tools/gpu_session.sh wheels, then install)"; return 2; fi
  # DeepSpeed builds its cpu_adam op by JIT on first use; with CUDA visible its builder wants the CUDA toolkit
  # (nvcc, CUDA_HOME; the H100 image of 2026-11-24 had it). Where the build fails the bench runs DeepSpeed with
  # torch's Adam (its torch_adam switch) and the table's optimizer column says so.
  command -v nvcc || echo "no nvcc here: DeepSpeed's cpu_adam build may fail (then torch_adam, named in the table)"
  $PY -m offload bench step --baseline deepspeed "${M156[@]}" --steps 4 --rounds 2 --out "$OUT/deepspeed/step-vs-deepspeed.json"
}

# DeepSpeed's other placements beside offload's (#20): params on the GPU with the optimizer on the host (its CPU Adam,
# and torch's Adam), half the optimizer state on the GPU (offload_optimizer.ratio 0.5), nothing offloaded.
deepspeed_placements() {
  if ! $PY -c "import deepspeed" 2>/dev/null; then echo "DeepSpeed is not installed here"; return 2; fi
  $PY -m offload bench step --baseline deepspeed "${M156[@]}" --steps 4 --rounds 2 \
    --variants optimizer-host,optimizer-host-torch-adam,ratio-half,device --out "$OUT/deepspeed-placements/step-vs-deepspeed.json"
}

# #20 on the 1.3B model: DeepSpeed beside offload with the optimizer on the host (params on the GPU, and both on the
# host). One micro-batch a step (the side-by-side times forward, backward and step), so --accum 1 here.
deepspeed_1p3b() {
  if ! $PY -c "import deepspeed" 2>/dev/null; then echo "DeepSpeed is not installed here"; return 2; fi
  $PY -m offload bench step --baseline deepspeed "${M1P3B[@]}" --accum 1 --steps 3 --rounds 2 \
    --variants optimizer-host,host --out "$OUT/deepspeed-1p3b/step-vs-deepspeed.json"
}

for s in "$@"; do
  case "$s" in
    wheels) stage wheels wheels ;;
    install) stage install install ;;
    bench-deepspeed-placements) stage bench-deepspeed-placements deepspeed_placements ;;
    cuda-tests) stage cuda-tests $PY -m pytest -q -x tests/test_engine_cuda.py tests/test_cli.py -k "cuda or gpu or pcie" ;;
    # The CUDA tests under torch's stream sanitizer: a kernel that reads what another stream writes without a wait fails.
    sanitizer) TORCH_CUDA_SANITIZER=1 stage sanitizer $PY -m pytest -q tests/test_engine_cuda.py ;;
    suite) FAIL_LOG=$OUT/failures.log PYTHONPATH=tools TAIL=30 stage suite timeout "${SUITE_S:-420}" $PY -m pytest -n 14 -q -p pytest_failures_now -p no:cacheprovider -p no:benchmark --timeout 150 ${SUITE_ARGS:-tests} ;;
    bench-hooks) stage bench-hooks $PY -m offload bench hooks --out "$OUT/hooks.json" ;;  # that host's Python per hook
    bench-pcie) stage bench-pcie $PY -m offload bench pcie --out "$OUT/pcie.json" ;;
    # CPU Adam over the 156M model's elements beside torch's AdamW and the host's measured bandwidth ceiling.
    bench-adam) stage bench-adam $PY -m offload bench adam --sizes 156M --out "$OUT/adam.json" ;;
    bench-step) stage bench-step $PY -m offload bench step "${M156[@]}" --unit-bytes 4Mi --steps 4 --rounds 2 --out "$OUT/step-4mi/step.json" ;;
    bench-step-default) stage bench-step-default $PY -m offload bench step "${M156[@]}" --unit-bytes 64Mi --steps 4 --rounds 2 --headline-only --out "$OUT/step-64mi/step.json" ;;
    bench-step-placement) stage bench-step-placement $PY -m offload bench step "${M156[@]}" --unit-bytes 64Mi --steps 4 --rounds 2 --variants host,clip-after,clip-speculative-kept,clip-speculative-recomputed,ratio-auto,ratio-half,delayed --out "$OUT/step-placement/step.json" ;;
    # The 1.3B model with the optimizer state where it is fastest (auto fills the GPU first) beside all on the host.
    bench-step-1p3b-auto) stage bench-step-1p3b-auto $PY -m offload bench step "${M1P3B[@]}" --unit-bytes 64Mi --steps 3 --rounds 2 --variants host,ratio-auto --out "$OUT/step-1p3b-auto/step.json" ;;
    # #22's "state that does not fit on the GPU": the same 1.3B model with offload held to a 12 GiB device budget (its
    # 21 GB of optimizer state and fp32 gradients cannot fit, about half does): the split auto chooses beside all on
    # the host. Plain PyTorch runs unbounded beside them.
    bench-step-1p3b-split) stage bench-step-1p3b-split $PY -m offload bench step "${M1P3B[@]}" --unit-bytes 64Mi --steps 3 --rounds 2 --variants host,ratio-auto --device-budget 12Gi --out "$OUT/step-1p3b-split/step.json" ;;
    # The same question on a model whose state does not fit the GPU at all (host memory: about 85 of 128 GiB).
    bench-step-4p5b) stage bench-step-4p5b $PY -m offload bench step "${M4P5B[@]}" --unit-bytes 64Mi --steps 2 --rounds 2 --variants ratio-auto,host --out "$OUT/step-4p5b/step.json" ;;
    bench-step-delayed) stage bench-step-delayed $PY -m offload bench step "${M156[@]}" --unit-bytes 64Mi --steps 4 --rounds 2 --variants host,delayed --out "$OUT/step-delayed/step.json" ;;
    bench-step-1p3b) stage bench-step-1p3b $PY -m offload bench step "${M1P3B[@]}" --unit-bytes 64Mi --steps 3 --rounds 2 --headline-only --out "$OUT/step-1p3b/step.json" ;;
    # torch's profiler over three steps of the headline variant: kernels per stream, the engine's phases per thread.
    profile) stage profile $PY -m offload bench step "${M156[@]}" --unit-bytes 4Mi --steps 3 --rounds 1 --headline-only --profile --out "$OUT/profile/step.json" ;;
    bench-deepspeed) stage bench-deepspeed deepspeed_side_by_side ;;
    bench-deepspeed-1p3b) stage bench-deepspeed-1p3b deepspeed_1p3b ;;
    # Params and optimizer state on NVMe (the lent machine's local disk under /tmp) beside both on the host.
    bench-step-nvme) stage bench-step-nvme $PY -m offload bench step "${M156[@]}" --offload nvme --path "${NVME_DIR:-/tmp/offload-nvme}" --unit-bytes 64Mi --steps 4 --rounds 2 --headline-only --out "$OUT/step-nvme/step.json" ;;
    # The optimizer state on NVMe stepped whole beside its pass run after step() returned (early_step on).
    bench-step-nvme-early) stage bench-step-nvme-early $PY -m offload bench step "${M156[@]}" --offload nvme --path "${NVME_DIR:-/tmp/offload-nvme}" --unit-bytes 64Mi --steps 4 --rounds 2 --variants host,nvme-optimizer,nvme-optimizer-early,nvme,nvme-early --out "$OUT/step-nvme-early/step.json" ;;
    *) echo "unknown stage $s" ;;
  esac
done
