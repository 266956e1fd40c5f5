#!/usr/bin/env bash
# The GPU path in one go, on a machine with one NVIDIA GPU (about 10 minutes):
#
#     bash bench/gpu_check.sh [LOG]          # default LOG: gpu_check.log
#     bash bench/gpu_check.sh --cpu-smoke    # the same python entry points, small, on CPU
#
# 1. `make install` (requirements/gpu.txt when nvidia-smi works);
# 2. a ~1B-parameter Llama built on the fly (demo/tiny_model.py: 20 layers, hidden 2048, bf16);
# 3. generation throughput, vLLM on CUDA against transformers (bench/generation.py);
# 4. one DeepSpeed learner step (tests/test_learner_step.py, which picks CUDA when present);
# 5. weight rounds into a vLLM engine on CUDA (bench/weight_sync.py: broadcast rounds, and
#    same-host rounds from a slot on the learner's device by CUDA IPC; the direct-copy load into
#    the engine's parameters, publish -> serving), with the ~1B model's shape, and the CUDA IPC
#    slot's own test (tests/test_shm_sync.py: bit-identical in another process);
# 6. a 20-step run of the demo (launch.demo, asynchronous mode).
# Every step has its own timeout; everything goes to one log, and a failing step does not stop
# the next. The last lines of the log say which steps passed.
set -u
cd "$(dirname "$0")/.."
SMOKE=0
LOG=gpu_check.log
if [ "${1:-}" = "--cpu-smoke" ]; then SMOKE=1; LOG=${2:-gpu_check_cpu_smoke.log}; elif [ -n "${1:-}" ]; then LOG=$1; fi
PY=.venv/bin/python
WORK=$(mktemp -d /tmp/conveyor-gpu-check.XXXXXX)
: > "$LOG"
declare -a RESULTS=()

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $(date -u +%H:%M:%S) $name (timeout ${limit}s): $*" >> "$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  RESULTS+=("$name rc=$rc $((SECONDS - t0))s")
  echo "=== $name: rc=$rc in $((SECONDS - t0))s" >> "$LOG"
}

if [ $SMOKE = 1 ]; then
  LAYERS=2; HIDDEN=256; INTER=512; REPS=2; STEPS=2; PROMPTS=4
else
  LAYERS=20; HIDDEN=2048; INTER=5632; REPS=3; STEPS=20; PROMPTS=64
  step "nvidia-smi" 30 nvidia-smi
  step "make install" 420 make install
fi

step "build model" 300 $PY -c "
from demo.tiny_model import build_tiny_model
p = build_tiny_model('$WORK/model', num_layers=$LAYERS, hidden_size=$HIDDEN, intermediate_size=$INTER, dtype='bfloat16')
import json, safetensors.torch as st, os
n = sum(t.numel() for t in st.load_file(os.path.join(p, 'model.safetensors')).values())
print(json.dumps({'model': str(p), 'params_m': round(n / 1e6, 1)}))"

step "generation vLLM vs transformers" 300 $PY bench/generation.py --models tiny,$WORK/model --prompts $PROMPTS --repeat 2
step "learner step" 240 $PY -m pytest -x -q tests/test_learner_step.py -p no:cacheprovider
step "CUDA IPC slot" 120 $PY -m pytest -x -q tests/test_shm_sync.py -k "cuda or device_slot" -p no:cacheprovider
step "weight rounds into vLLM" 300 $PY bench/weight_sync.py --layers $LAYERS --hidden $HIDDEN \
  --intermediate $INTER --reps $REPS
step "demo ($STEPS steps)" 420 $PY -m launch.demo --learner.total_steps $STEPS --demo.warm_steps 0 \
  --demo.out "$WORK/demo"

{ echo "=== summary"; printf '%s\n' "${RESULTS[@]}"; } >> "$LOG"
printf '%s\n' "${RESULTS[@]}"
rm -rf "$WORK"
