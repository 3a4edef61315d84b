#!/usr/bin/env bash
# Every GPU measurement and test the open issues name (#84's ranked rows), in stages, each logged to $OUT/<stage>.log.
#
# Before a loan, here (with network): build what the lent machine lacks (it has no network) into .whl/ (about
# 10 MiB, git ignores it; it travels as carry):
#   tools/gpu_session.sh wheels
# A loan is 15 minutes of device time in all (the start, about 65 s with install, and idle waits counted); the machine
# goes back after 30 s idle, so issue each call the moment the one before returns. Each Python command is cut at
# STAGE_S seconds, and the logs are re-tarred into $BUNDLE after every stage (BUNDLE before OUT: the tool's $OUT), so
# a call cut at its limit still brings back what finished. The calls, in #84's rank order:
# 1. rows 1-2: the streamed lane's CUDA tests, the same under TORCH_CUDA_SANITIZER, then the 0.91B GPT homed on the
#    host (host lane, streamed lane, auto), clipping off then on, each beside plain PyTorch and its floor:
#      run(carry=[".whl"], timeout_s=560, command='BUNDLE=$OUT/p68.tgz OUT=/tmp/gs STAGE_S=200 tools/gpu_session.sh plan68')
# 2. offload_states, Lion/Adagrad/Muon and zero.Init on the GPU, offload_states' round trip, the compiled units and
#    the compiled 0.91B beside eager (prefix `install` if the machine went cold):
#      run(carry=[".whl"], timeout_s=560, command='BUNDLE=$OUT/p69.tgz OUT=/tmp/gs STAGE_S=200 tools/gpu_session.sh plan69')
# 3. with time left: plan44a (0.91B and 4.5B against the floor), plan44b (CUDA tests, the 8B Llama through the Trainer
#    beside DeepSpeed and plain PyTorch), trl-sft-8b (#83's row: TRL's SFTTrainer through the switch beside DeepSpeed;
#    `tools/gpu_session.sh trl_wheels` here first: .whl/trl is 55 MiB (2026-12-07), .whl and it together over the
#    64 MiB carry, so run it in a call of its own right after one that carried .whl and installed, carry=[".whl/trl"]
#    (a warm machine keeps .whl)), plan55 (the 4.5B with 16-bit state), largest (a call of its own).
# The last timings (H200, 2026-11-27): install 40 s, cuda-tests 15-59 s, pace-0p9b one round 120 s; pace-4p5b needs a
# call of its own (STAGE_S=400); suite a call of its own (SUITE_S, default 420 s, 14 workers). After a loan, replay
# the same model's recorded step graph here (`offload bench schedule`) beside what was measured. What each loan
# measured and taught: docs/performance.md, "On a GPU" and "The session script's history".
#
# Every stage by name:
#   install cuda-streamed cuda-tests bench-pcie bench-adam bench-hooks bench-step bench-step-default bench-step-placement
#   bench-step-delayed bench-step-hiding bench-step-1p3b bench-step-1p3b-auto bench-step-1p3b-split bench-step-4p5b bench-step-nvme
#   bench-step-nvme-optimizer bench-step-nvme-early bench-deepspeed bench-deepspeed-device bench-deepspeed-placements bench-deepspeed-1p3b
#   bench-deepspeed-nvme bench-step-checkpointing bench-step-threads profile sanitizer suite
#   pace-0p9b pace-0p9b-lanes pace-4p5b pace-4p5b-budget pace-4p5b-formats trainer-8b trainer-8b-refit largest
#   cuda-lend bench-lend cuda-compile bench-step-compile sanitizer-streamed trl-sft-8b
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

# Where the lent machine lacks libaio, the copy `wheels` carried: gcc finds it by these (DeepSpeed's async_io build
# and its check for io_submit both run gcc), the loader by the last.
if [ -d .whl/libaio ] && [ ! -e /usr/include/libaio.h ]; then
  export CPATH=$PWD/.whl/libaio/include${CPATH:+:$CPATH} LIBRARY_PATH=$PWD/.whl/libaio/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
  export LD_LIBRARY_PATH=$PWD/.whl/libaio/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

# Each Python command is cut at STAGE_S seconds, with the processes it started (timeout signals its process group).
py() { timeout -k 15 "${STAGE_S:-300}" "$PY" "$@"; }

stage() {  # name, command...: run one stage, log it, never stop the others
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo " (cut at STAGE_S=${STAGE_S:-300} s)")"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  if [ -n "${BUNDLE:-}" ]; then  # what finished so far comes back even if the call is cut later
    tar czf "$OUT.tgz.part" -C "$OUT" . && mv "$OUT.tgz.part" "$BUNDLE"
  fi
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
  { libaio || echo "no libaio here (apt-get install libaio-dev): DeepSpeed's NVMe stage needs it on the lent machine"; } &&
  du -sh .whl && ls .whl
}

libaio() {  # DeepSpeed's async_io op (its NVMe variant) is built by its JIT there: libaio's header and library (plain
  # files, 20 KiB), the library under its own soname (libaio.so.1, or libaio.so.1t64 on Debian 13 / Ubuntu 24.04) and
  # as libaio.so for the linker; optional, only bench-deepspeed-nvme needs it
  local lib soname
  lib=$(ldconfig -p | awk '/libaio\.so\.1/ && /x86-64/ {print $NF; exit}')
  [ -e /usr/include/libaio.h ] && [ -n "$lib" ] || return 1
  soname=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\].*/\1/p')
  mkdir -p .whl/libaio/include .whl/libaio/lib &&
  cp /usr/include/libaio.h .whl/libaio/include/ &&
  cp -L "$lib" ".whl/libaio/lib/${soname:-libaio.so.1}" &&
  cp -L "$lib" .whl/libaio/lib/libaio.so
}

trl_wheels() {  # here, for the trl-sft-8b stage: TRL, datasets and what datasets needs beyond transformers' own
  # requirements, as 3.12 wheels without their dependencies (pyarrow is most of it, about 45 MiB: carry .whl alone)
  mkdir -p .whl/trl &&
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/trl \
    "trl==$($PY -c 'import trl; print(trl.__version__)')" "datasets==$($PY -c 'import datasets; print(datasets.__version__)')" \
    pyarrow dill multiprocess xxhash "fsspec[http]" &&
  du -sh .whl/trl && ls .whl/trl
}

# #83's row: TRL's SFTTrainer on the 8B Llama shape, offload behind the switch beside DeepSpeed's own ZeRO-3 offload,
# one config file for both (the deepspeed side's of trainer-8b), and plain PyTorch (its out-of-memory shown)
trl_sft_8b() {
  $PY -m pip install -q --no-index --no-deps .whl/trl/*.whl || echo "TRL's wheels missing: tools/gpu_session.sh trl_wheels here first"
  local d=$OUT/trl-sft-8b; mkdir -p "$d"
  local base='"bf16": {"enabled": true}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}'
  echo "{$base, \"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"cpu\", \"pin_memory\": true}, \"offload_optimizer\": {\"device\": \"cpu\", \"pin_memory\": true}}}" > "$d/config.json"
  local side
  for side in ${TRAINER_SIDES:-switch deepspeed plain}; do
    STAGE_S=${TRAINER_S:-240} py tools/trainer_pace.py --trainer sft --side "$side" --config "$d/config.json" \
      --out "$d/$side.json" --steps "${TRAINER_STEPS:-3}" --warmup 2 || echo "$side: rc=$?"
  done
}

install() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
  $PY -m pip install -q --no-index --no-build-isolation --no-deps .whl/liburing-*.tar.gz .whl/dynamic_import-* &&
  $PY -m pip install -q --no-index --no-build-isolation --no-deps -e . &&
  $PY -c "import offload, offload._native as n; from offload.aio import probe_io_uring; print('native', offload.machine.native.active_variant()); print(probe_io_uring())" &&
  $PY -m offload info &&  # the CPUs this process may use beside the host's count (offload/machine/cpus.py)
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
  py -m offload bench step --baseline deepspeed "${M156[@]}" --steps 4 --rounds 2 --out "$OUT/deepspeed/step-vs-deepspeed.json"
}

checkpointing_both() {
  local where
  for where in device cpu; do
    py -m offload bench step "${M156[@]}" --unit-bytes 64Mi --steps 3 --rounds 2 --headline-only --checkpointing "$where" --out "$OUT/step-checkpointing-$where/step.json"
  done
}

# DeepSpeed's other placements beside offload's (#20): params on the GPU with the optimizer on the host (its CPU Adam,
# and torch's Adam), half the optimizer state on the GPU (offload_optimizer.ratio 0.5), nothing offloaded.
deepspeed_placements() {
  if ! $PY -c "import deepspeed" 2>/dev/null; then echo "DeepSpeed is not installed here"; return 2; fi
  py -m offload bench step --baseline deepspeed "${M156[@]}" --steps 4 --rounds 2 \
    --variants optimizer-host,optimizer-host-torch-adam,ratio-half,device --out "$OUT/deepspeed-placements/step-vs-deepspeed.json"
}

# #20 on the 1.3B model: DeepSpeed beside offload with params and optimizer on the host (DeepSpeed starts in about
# 45 s a variant and round there, so one variant). One micro-batch a step (the side-by-side times forward, backward
# and step), so --accum 1 here.
deepspeed_1p3b() {
  if ! $PY -c "import deepspeed" 2>/dev/null; then echo "DeepSpeed is not installed here"; return 2; fi
  STAGE_S=${DS_1P3B_S:-380} py -m offload bench step --baseline deepspeed "${M1P3B[@]}" --accum 1 --steps 2 --warmup 2 --rounds 2 \
    --variants "${DS_1P3B_VARIANTS:-host}" --out "$OUT/deepspeed-1p3b/step-vs-deepspeed.json"
}

# #20's "likewise with both on NVMe" on the GPU, never run there: params and optimizer state on NVMe (the lent
# machine's disk under /tmp) through DeepSpeed's ZeRO-Infinity beside offload's, one config file. DeepSpeed builds
# async_io and cpu_adam by JIT first (libaio from .whl where the machine lacks it); a step is seconds there (offload's
# was 1.8-2.1 s), so two timed steps a round after two warm-ups (this side by side counts no bytes), cut at DS_NVME_S.
deepspeed_nvme() {
  if ! $PY -c "import deepspeed" 2>/dev/null; then echo "DeepSpeed is not installed here"; return 2; fi
  echo "libaio: $(ls /usr/include/libaio.h 2>/dev/null || echo "carried: ${CPATH:-none}")"
  STAGE_S=${DS_NVME_S:-240} py -m offload bench step --baseline deepspeed "${M156[@]}" --offload nvme \
    --path "${NVME_DIR:-/tmp/offload-nvme}" --steps 2 --warmup 2 --rounds 2 --variants nvme --out "$OUT/deepspeed-nvme/step-vs-deepspeed.json"
}

# #20 on the GPU where it was never run: nothing offloaded (DeepSpeed's FusedAdam after the arch-list fix), beside
# params and optimizer on the host.
deepspeed_device() {
  if ! $PY -c "import deepspeed" 2>/dev/null; then echo "DeepSpeed is not installed here"; return 2; fi
  py -m offload bench step --baseline deepspeed "${M156[@]}" --steps 4 --rounds 2 \
    --variants host,device --out "$OUT/deepspeed-device/step-vs-deepspeed.json"
}

adam_threads() {  # its JSON records the host's cores and those this process may use (install printed them too)
  py -m offload bench adam --sizes 156M --out "$OUT/adam.json" &&
  py -m offload bench adam --sizes 156M --threads "$($PY -c 'from offload.machine import cpus; print(cpus.usable_cpus())')" \
    --out "$OUT/adam-all-cpus.json"
}

# #44: a model larger than the GPU at the GPU's pace. Each row beside plain PyTorch in the same run, with its floor
# (max of plain PyTorch's forward + backward and the host's Adam share at the host step's rate measured in the run):
# the 0.91B GPT (16 x 2048, seq 1024, micro-batch 8) and the 4.5B one (28 x 3584, seq 1024, micro-batch 4), bf16,
# no clipping; full offload, auto beside host params, auto with params on the GPU. auto without a budget keeps to
# half the GPU's free memory (the activations' share is not measured yet), so the 4.5B model runs again under a
# device budget that leaves its activations about 10 GiB.
M091=(--device cuda --world 1 --dtype bf16 --hidden 2048 --layers 16 --seq 1024 --vocab 50304 --micro 8)
M4P5B_SEQ1K=(--device cuda --world 1 --dtype bf16 --hidden 3584 --layers 28 --seq 1024 --vocab 50304 --micro 4)
pace() {  # name, extra flags...
  local name=$1; shift
  py -m offload bench step --baseline floor --clip 0 --unit-bytes 64Mi "$@" --out "$OUT/$name/step-vs-floor.json"
}

pace_formats() {  # #55: the 4.5B GPT, full offload (FORMAT_VARIANTS: full,auto for auto too), with the state in fewer bytes (beside pace-4p5b's fp32)
  local fmt
  for fmt in bf16-moments 16+16 bf16-master; do
    pace "pace-4p5b-$fmt" "${M4P5B_SEQ1K[@]}" --steps 3 --warmup 2 --rounds 1 --variants "${FORMAT_VARIANTS:-full}" --state-format "$fmt"
  done
}

# #44's 8B Llama-3-shaped model (hidden 4096, 32 layers, 8 KV heads, intermediate 14336, vocabulary 128256, seq 2048,
# bf16, activation checkpointing) through offload.hf.Trainer, then DeepSpeed through transformers' deepspeed=, then
# plain PyTorch (its out-of-memory shown): tools/trainer_pace.py, one process a side. offload reads the config with
# ratio auto under a 68 GiB device budget (an offload key DeepSpeed ignores); DeepSpeed's ratio is a number only, so
# it reads the same file with the whole optimizer state on the host (ZeRO-Infinity's usual setting).
trainer_8b() {  # TRAINER_BUDGET: offload's device budget (default 68GiB; empty: none, auto refitted by its peak)
  local d=$OUT/trainer-8b${TRAINER_TAG:-}; mkdir -p "$d"
  local budget=${TRAINER_BUDGET-68GiB} extra=""
  [ -n "$budget" ] && extra=", \"offload\": {\"budgets\": {\"device\": \"$budget\"}}"
  local base='"bf16": {"enabled": true}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}'
  echo "{$base, \"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"cpu\", \"pin_memory\": true}, \"offload_optimizer\": {\"device\": \"cpu\", \"pin_memory\": true, \"ratio\": \"auto\"}}$extra}" > "$d/config-offload.json"
  echo "{$base, \"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"cpu\", \"pin_memory\": true}, \"offload_optimizer\": {\"device\": \"cpu\", \"pin_memory\": true}}}" > "$d/config-deepspeed.json"
  local side
  for side in ${TRAINER_SIDES:-offload deepspeed plain}; do
    local config=$d/config-offload.json; [ "$side" = offload ] || config=$d/config-deepspeed.json
    STAGE_S=${TRAINER_S:-240} py tools/trainer_pace.py --side "$side" --config "$config" --out "$d/$side.json" \
      --steps "${TRAINER_STEPS:-3}" --warmup 2 || echo "$side: rc=$?"
  done
}

stages=()
for s in "$@"; do
  case "$s" in
    plan1) stages+=(install cuda-tests sanitizer bench-step-threads bench-step-checkpointing) ;;
    plan2) stages+=(bench-deepspeed-1p3b) ;;
    # #44 in two calls of about ten minutes (run(carry=[".whl"], timeout_s=600, command='BUNDLE=$OUT/p44a.tgz
    # OUT=/tmp/gs STAGE_S=280 tools/gpu_session.sh plan44a'), then plan44b the same way, with install first if cold).
    plan44a) stages+=(install pace-0p9b pace-4p5b) ;;
    plan44b) stages+=(cuda-tests trainer-8b pace-4p5b-budget) ;;
    plan55) stages+=(install pace-4p5b-formats) ;;
    plan59) stages+=(install cuda-tests pace-0p9b) ;;  # cuda-tests: 15 s on the H200 (2026-11-27)
    plan68) stages+=(install cuda-streamed sanitizer-streamed pace-0p9b-lanes) ;;  # the lanes first, whenever a device is lent (#71's row 1)
    # #69 and #70 on a GPU (after plan68, with time left): the CUDA tests of offload_states (the GPU's freed bytes),
    # Lion/Adagrad and Muon, the 0.91B's offload_states round trip beside the bus and DeepSpeed's (#70's RLHF
    # measurement; untimed: about a minute is the guess), the compiled units, then the 0.91B compiled beside eager,
    # offload and plain PyTorch (#71's row 4).
    plan69) stages+=(install cuda-lend bench-lend cuda-compile bench-step-compile) ;;
    *) stages+=("$s") ;;
  esac
done
for s in "${stages[@]}"; do
  case "$s" in
    bench-deepspeed-device) stage bench-deepspeed-device deepspeed_device ;;
    wheels) stage wheels wheels ;;
    install) stage install install ;;
    bench-deepspeed-placements) stage bench-deepspeed-placements deepspeed_placements ;;
    cuda-streamed) stage cuda-streamed py -m pytest -q -x tests/test_engine_cuda.py -k streamed ;;  # correct first
    cuda-lend) stage cuda-lend py -m pytest -q -x tests/test_engine_cuda.py -k "offload_states or lion or muon or init_on_the_gpu" ;;
    bench-lend) stage bench-lend py -m offload bench lend --device cuda --dtype bf16 --hidden 2048 --layers 16 --vocab 50304 --rounds 5 --out "$OUT/lend.json" ;;
    # compiled blocks under the engine on the GPU (test_compile.py trains on the GPU at W = 1), inductor's first compile
    cuda-compile) stage cuda-compile py -m pytest -q -x tests/test_compile.py ;;
    # plain PyTorch and offload (the state split by auto), each eager and with every block compiled by inductor
    bench-step-compile) stage bench-step-compile py -m offload bench step "${M091[@]}" --compile inductor --variants ratio-auto --steps 4 --rounds 2 --out "$OUT/step-compile.json" ;;
    cuda-tests) stage cuda-tests py -m pytest -q -x tests/test_engine_cuda.py tests/test_cli.py tests/test_bench_pace.py -k "cuda or gpu or pcie" ;;
    # The CUDA tests under torch's stream sanitizer: a kernel that reads what another stream writes without a wait fails.
    sanitizer) TORCH_CUDA_SANITIZER=1 stage sanitizer py -m pytest -q tests/test_engine_cuda.py ;;
    # the streamed lane's alone (plan68): its ring is read by compute and rewritten by the copy streams each step
    sanitizer-streamed) TORCH_CUDA_SANITIZER=1 stage sanitizer-streamed py -m pytest -q tests/test_engine_cuda.py -k streamed ;;
    # The static checks (ruff, mypy) need no GPU and are not carried there: left out where their tools are missing.
    suite) static=$($PY -c "import ruff, mypy" 2>/dev/null || echo "--ignore tests/test_lint.py --ignore tests/test_types.py")
           FAIL_LOG=$OUT/failures.log PYTHONPATH=tools TAIL=30 stage suite timeout "${SUITE_S:-420}" $PY -m pytest -n 14 -q -p pytest_failures_now -p no:cacheprovider -p no:benchmark --timeout 150 $static ${SUITE_ARGS:-tests} ;;
    bench-hooks) stage bench-hooks py -m offload bench hooks --out "$OUT/hooks.json" ;;  # that host's Python per hook
    bench-pcie) stage bench-pcie py -m offload bench pcie --out "$OUT/pcie.json" ;;
    # CPU Adam over the 156M model's elements beside torch's AdamW and the host's measured bandwidth ceiling.
    # Its threads: the physical cores this process may use (offload/machine/cpus.py; `offload info` says how many), then
    # every CPU it may use, in case that host's memory wants more threads in flight than its cores.
    bench-adam) stage bench-adam adam_threads ;;
    bench-step) stage bench-step py -m offload bench step "${M156[@]}" --unit-bytes 4Mi --steps 4 --rounds 2 --out "$OUT/step-4mi/step.json" ;;
    bench-step-default) stage bench-step-default py -m offload bench step "${M156[@]}" --unit-bytes 64Mi --steps 4 --rounds 2 --headline-only --out "$OUT/step-64mi/step.json" ;;
    bench-step-placement) stage bench-step-placement py -m offload bench step "${M156[@]}" --unit-bytes 64Mi --steps 4 --rounds 2 --variants host,clip-after,clip-speculative-kept,clip-speculative-recomputed,ratio-auto,ratio-half,delayed --out "$OUT/step-placement/step.json" ;;
    # The 1.3B model with the optimizer state where it is fastest (auto fills the GPU first) beside all on the host.
    bench-step-1p3b-auto) stage bench-step-1p3b-auto py -m offload bench step "${M1P3B[@]}" --unit-bytes 64Mi --steps 3 --rounds 2 --variants host,ratio-auto --out "$OUT/step-1p3b-auto/step.json" ;;
    # #22's "state that does not fit on the GPU": the same 1.3B model with offload held to a 12 GiB device budget (its
    # 21 GB of optimizer state and fp32 gradients cannot fit, about half does): the split auto chooses beside all on
    # the host. Plain PyTorch runs unbounded beside them.
    bench-step-1p3b-split) stage bench-step-1p3b-split py -m offload bench step "${M1P3B[@]}" --unit-bytes 64Mi --steps 3 --rounds 2 --variants host,ratio-auto --device-budget 12Gi --out "$OUT/step-1p3b-split/step.json" ;;
    # The same question on a model whose state does not fit the GPU at all (host memory: about 85 of 128 GiB).
    bench-step-4p5b) stage bench-step-4p5b py -m offload bench step "${M4P5B[@]}" --unit-bytes 64Mi --steps 2 --rounds 2 --variants ratio-auto,host --out "$OUT/step-4p5b/step.json" ;;
    # The two ways of hiding the host Adam beside the exact early step: speculated during backward, on its own lane
    # (H200, third loan: 0.93-0.94x the host step kept, 1.37x recomputed) and the delayed update (0.80-0.82x).
    bench-step-hiding) stage bench-step-hiding py -m offload bench step "${M156[@]}" --unit-bytes 64Mi --steps 4 --rounds 2 --variants host,clip-speculative-kept,clip-speculative-recomputed,delayed --out "$OUT/step-hiding/step.json" ;;
    # Every block checkpointed, its saved inputs on the GPU, then in host memory (torch runs without, beside it): the
    # GPU memory high water each saves and the recompute's cost.
    bench-step-checkpointing) stage bench-step-checkpointing checkpointing_both ;;
    # The host Adam on every core this process may use beside two fewer (the training thread and the driver keep
    # theirs): it ran at 110-115 GB/s inside the H200's step against 159 GB/s alone. Its host row is the headline too.
    bench-step-threads) stage bench-step-threads py -m offload bench step "${M156[@]}" --unit-bytes 64Mi --steps 4 --rounds 3 --variants host,host-spare-cores --out "$OUT/step-threads/step.json" ;;
    bench-step-delayed) stage bench-step-delayed py -m offload bench step "${M156[@]}" --unit-bytes 64Mi --steps 4 --rounds 2 --variants host,delayed --out "$OUT/step-delayed/step.json" ;;
    bench-step-1p3b) stage bench-step-1p3b py -m offload bench step "${M1P3B[@]}" --unit-bytes 64Mi --steps 3 --rounds 2 --headline-only --out "$OUT/step-1p3b/step.json" ;;
    # torch's profiler over three steps of the headline variant: kernels per stream, the engine's phases per thread.
    profile) stage profile py -m offload bench step "${M156[@]}" --unit-bytes 4Mi --steps 3 --rounds 1 --headline-only --profile --out "$OUT/profile/step.json" ;;
    bench-deepspeed) stage bench-deepspeed deepspeed_side_by_side ;;
    bench-deepspeed-1p3b) stage bench-deepspeed-1p3b deepspeed_1p3b ;;
    bench-deepspeed-nvme) stage bench-deepspeed-nvme deepspeed_nvme ;;
    # Params and optimizer state on NVMe (the lent machine's local disk under /tmp) beside both on the host.
    bench-step-nvme) stage bench-step-nvme py -m offload bench step "${M156[@]}" --offload nvme --path "${NVME_DIR:-/tmp/offload-nvme}" --unit-bytes 64Mi --steps 4 --rounds 2 --headline-only --out "$OUT/step-nvme/step.json" ;;
    # The optimizer state on NVMe, params on the GPU, stepped during backward (speculated when clipping did not fire
    # the step before) beside after backward: never measured on a GPU.
    bench-step-nvme-optimizer) stage bench-step-nvme-optimizer py -m offload bench step "${M156[@]}" --offload nvme --path "${NVME_DIR:-/tmp/offload-nvme}" --unit-bytes 64Mi --steps 3 --rounds 2 --variants nvme-optimizer,nvme-optimizer-speculative-kept --out "$OUT/step-nvme-optimizer/step.json" ;;
    # Params and optimizer state on NVMe, stepped whole beside their NVMe passes run after step() returned (early on).
    bench-step-nvme-early) stage bench-step-nvme-early py -m offload bench step "${M156[@]}" --offload nvme --path "${NVME_DIR:-/tmp/offload-nvme}" --unit-bytes 64Mi --steps 4 --rounds 2 --variants nvme,nvme-early --out "$OUT/step-nvme-early/step.json" ;;
    # 0.91B: auto keeps nearly all the state on an H200 (33.6M of 910.8M elements on the host), so params-device adds
    # nothing there; full (the host Adam during backward, auto since session 45) beside full-after is the open question.
    pace-0p9b) stage pace-0p9b pace pace-0p9b "${M091[@]}" --steps 4 --warmup 2 --rounds 1 --variants full,full-after,auto ;;
    # #68's streamed lane beside the host one, clipping off and on (#71's first row): the 0.91B GPT, everything on the host
    pace-0p9b-lanes) stage pace-0p9b-lanes pace pace-0p9b-lanes "${M091[@]}" --steps 4 --warmup 2 --rounds 1 --variants full,stream-auto,stream-half,stream-all &&
      stage pace-0p9b-lanes-clip pace pace-0p9b-lanes-clip "${M091[@]}" --clip 1.0 --steps 4 --warmup 2 --rounds 1 --variants full,stream-auto,stream-half,stream-all ;;
    pace-4p5b) stage pace-4p5b pace pace-4p5b "${M4P5B_SEQ1K[@]}" --steps 3 --warmup 2 --rounds 1 --variants "${PACE_4P5B_VARIANTS:-full,auto,auto-params-device}" ;;
    pace-4p5b-budget) stage pace-4p5b-budget pace pace-4p5b-budget "${M4P5B_SEQ1K[@]}" --steps 3 --warmup 2 --rounds 1 --device-budget 68Gi --variants auto,auto-params-device ;;
    pace-4p5b-formats) stage pace-4p5b-formats pace_formats ;;
    trainer-8b) STAGE_S=${TRAINER_S:-240} stage trainer-8b trainer_8b ;;
    trl-sft-8b) STAGE_S=${TRAINER_S:-240} stage trl-sft-8b trl_sft_8b ;;
    trl_wheels) stage trl-wheels trl_wheels ;;
    largest) stage largest py tools/largest_pace.py --nvme-path /tmp/nvme-largest --out "$OUT/largest.json" ;;
    trainer-8b-refit) TRAINER_SIDES=offload TRAINER_BUDGET= TRAINER_TAG=-refit STAGE_S=${TRAINER_S:-240} stage trainer-8b-refit trainer_8b ;;
    *) echo "unknown stage $s" ;;
  esac
done
