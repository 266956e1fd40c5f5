#!/usr/bin/env bash
# The GPU path in one go, on a machine with one NVIDIA GPU (the steps after the install: under 10
# minutes; each timeout below is a bound, not an estimate):
#
#     bash bench/gpu_check.sh [LOG]                # default LOG: gpu_check.log
#     bash bench/gpu_check.sh --cpu-smoke [LOG]    # the same entry points, small, on the CPU (~3 min)
#
#  1. nvidia-smi, `make install` (requirements/gpu.txt), and scripts/check_cuda.py (driver against
#     torch's and vLLM's CUDA, compute capability, Triton's compiler and headers);
#  2. a ~1B-parameter Llama built on the fly (demo/tiny_model.py: 20 layers, hidden 2048, bf16);
#  3. the device plan of the demo's config for this machine (`launch.local CONFIG --plan`);
#  4. generation throughput, vLLM on CUDA against transformers (bench/generation.py);
#  5. DeepSpeed learner steps (tests/learner/test_step.py, which picks CUDA when present);
#  6. the CUDA IPC slot (tests/weight_sync/test_shm.py -k cuda: bit-identical in another process);
#  7. weight rounds into a vLLM engine on CUDA with the ~1B model's shape (bench/weight_sync.py:
#     broadcast rounds, and same-host rounds from a slot on the learner's device by CUDA IPC);
#  8. a member killed mid-broadcast (bench/killed_member.py): the learner's sender survives and the
#     next round reaches the other member, over gloo, and over NCCL where there are 3 GPUs (one per
#     rank: NCCL refuses two ranks on one device); on one GPU, a weight-sync NCCL group whose peer
#     never comes (bench/absent_peer.py): the round fails by its deadline and the process outlives
#     the NCCL watchdog;
#  9. vLLM's V2 model runner (the default on GPU in vLLM 0.33: VLLM_USE_V2_MODEL_RUNNER, read in
#     vllm/envs.py and vllm/config/vllm.py `use_v2_model_runner`) and the V1 runner, each a short
#     greedy generation through the project's engine (actors/engines/vllm/engine.py), both recorded;
# 10. sequence parallelism's split forward and gradient (tests/learner/test_sequence_parallel.py):
#     over gloo, and over NCCL where there are 2 GPUs;
# 11. a tiny mixture of experts end to end (tests/system/test_moe.py): routing replay, weight rounds
#     into vLLM's fused-MoE layers, engine and learner agreeing at staleness 0 (GPU only);
# 12. a tiny vision-language model (Qwen2-VL) on vLLM's CUDA engine, and end to end (GPU only);
# 13. the demo (launch.demo, asynchronous: 20 steps; 2 in --cpu-smoke).
#
# On a GPU every step records the peak of `nvidia-smi --query-gpu=memory.used` while it ran (the
# engine's memory is in its own process, out of reach of torch.cuda.max_memory_allocated here).
# Every step has its own timeout; everything goes to one log; a failing step does not stop the
# next. The summary at the end (stdout and the log's last lines) has one line per step: PASS, FAIL
# or SKIP (a GPU-only step in --cpu-smoke: "skipped: no GPU"). Exit status 1 when any step failed.
set -u
cd "$(dirname "$0")/.."
SMOKE=0
LOG=gpu_check.log
if [ "${1:-}" = "--cpu-smoke" ]; then SMOKE=1; LOG=${2:-gpu_check_cpu_smoke.log}; elif [ -n "${1:-}" ]; then LOG=$1; fi
case "${1:-}" in -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
PY=${PY:-.venv/bin/python}
# every entry point below finds the project from the repository root itself; a PYTHONPATH holding the
# root would make `bench/weight_sync.py` shadow the `weight_sync` package in bench/generation.py
unset PYTHONPATH
WORK=$(mktemp -d /tmp/conveyor-gpu-check.XXXXXX)
SAMPLER=""
cleanup() { [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
: > "$LOG"
declare -a SUMMARY=()
PASSED=0; FAILED=0; SKIPPED=0
GPUS=0
if [ $SMOKE = 0 ] && command -v nvidia-smi >/dev/null 2>&1; then GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU '); fi

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $(date -u +%H:%M:%S) $name (timeout ${limit}s): $*" >> "$LOG"
  local t0=$SECONDS mem=""
  if [ "$GPUS" -gt 0 ]; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$WORK/mem" 2>/dev/null &
    SAMPLER=$!
  fi
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  if [ -n "$SAMPLER" ]; then
    kill "$SAMPLER" 2>/dev/null; wait "$SAMPLER" 2>/dev/null; SAMPLER=""
    mem=", peak GPU memory $(sort -n "$WORK/mem" | tail -1) MiB"
  fi
  local took=$((SECONDS - t0)) line
  if [ $rc = 0 ]; then
    PASSED=$((PASSED + 1)); line="PASS  $name (${took}s$mem)"
  else
    FAILED=$((FAILED + 1)); line="FAIL  $name: rc=$rc$([ $rc = 124 ] && echo ' (timed out)') (${took}s$mem)"
  fi
  SUMMARY+=("$line")
  echo "=== $line" >> "$LOG"
}

skip() {  # skip NAME REASON
  SKIPPED=$((SKIPPED + 1))
  SUMMARY+=("SKIP  $1: skipped: $2")
  echo "=== SKIP $1: skipped: $2" >> "$LOG"
}

gpu_step() {  # gpu_step NAME TIMEOUT_S COMMAND...: a step that only means something on a GPU
  if [ $SMOKE = 1 ]; then skip "$1" "no GPU"; else step "$@"; fi
}

# A short greedy generation through the project's engine; argv: model folder, JSON out. The model
# runner vLLM chose is its config's `use_v2_model_runner` (vllm/config/vllm.py).
RUNNER_PY='
import json, sys, time
if __name__ == "__main__":
    from actors.engines.base import Sampling
    from actors.engines.vllm.engine import VLLMEngine
    t0 = time.monotonic()
    eng = VLLMEngine(sys.argv[1], dtype="bfloat16", max_model_len=256)
    start_s = time.monotonic() - t0
    try:
        v2 = eng.llm.llm_engine.vllm_config.use_v2_model_runner
    except Exception as e:
        v2 = "unknown: %s" % type(e).__name__
    prompts = [[4 + (7 * i + j) % 60 for j in range(8)] for i in range(32)]
    t0 = time.monotonic()
    groups = eng.generate(prompts, 1, Sampling(temperature=0.0, max_tokens=32))
    gen_s = time.monotonic() - t0
    eng.close()
    toks = [list(g[0].token_ids) for g in groups]
    out = {"use_v2_model_runner": v2, "startup_s": round(start_s, 1), "generate_s": round(gen_s, 3),
           "tokens": sum(map(len, toks)), "greedy": toks}
    json.dump(out, open(sys.argv[2], "w"))
    print(json.dumps({k: v for k, v in out.items() if k != "greedy"}))
'
SAME_GREEDY_PY='
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
same = sum(x == y for x, y in zip(a["greedy"], b["greedy"]))
print("V2 runner %s vs V1 runner %s: %d/%d greedy completions identical; generate %ss vs %ss" % (
    a["use_v2_model_runner"], b["use_v2_model_runner"], same, len(a["greedy"]), a["generate_s"], b["generate_s"]))
'

if [ $SMOKE = 1 ]; then
  LAYERS=2; HIDDEN=256; INTER=512; STEPS=2
  skip "nvidia-smi" "no GPU"
  step "make install (dry run)" 60 make -n install STACK=cpu
  skip "CUDA check (scripts/check_cuda.py)" "no GPU"
else
  LAYERS=20; HIDDEN=2048; INTER=5632; STEPS=20
  step "nvidia-smi" 30 nvidia-smi
  step "make install" 900 make install
  step "CUDA check (scripts/check_cuda.py)" 60 $PY scripts/check_cuda.py
fi

step "build model" 300 $PY -c "
from demo.tiny_model import build_tiny_model
p = build_tiny_model('$WORK/model', num_layers=$LAYERS, hidden_size=$HIDDEN, intermediate_size=$INTER, dtype='bfloat16')
import json, safetensors.torch as st, os
n = sum(t.numel() for t in st.load_file(os.path.join(p, 'model.safetensors')).values())
print(json.dumps({'model': str(p), 'params_m': round(n / 1e6, 1)}))"

: > "$WORK/prompts.jsonl"
step "device plan" 60 $PY -m launch.local examples/demo.yaml --plan --generator.model "$WORK/model" \
  --learner.model_path "$WORK/model" --buffer.prompts "$WORK/prompts.jsonl"

if [ $SMOKE = 1 ]; then
  step "generation vLLM vs transformers" 300 $PY bench/generation.py --models "$WORK/model" --prompts 4 --n 1 \
    --max-tokens 8 --repeat 1 --cpu-linear auto
  # one learner step (the whole file takes minutes on two cores)
  step "learner step" 240 $PY -m pytest -x -q tests/learner/test_step.py -k one_step_with_positive -p no:cacheprovider
else
  step "generation vLLM vs transformers" 300 $PY bench/generation.py --models "tiny,$WORK/model" --prompts 64 \
    --repeat 2 --cpu-linear auto
  step "learner step" 240 $PY -m pytest -x -q tests/learner/test_step.py -p no:cacheprovider
fi
# on the CPU the device-slot test runs and the CUDA one is skipped by pytest
step "CUDA IPC slot" 120 $PY -m pytest -x -q tests/weight_sync/test_shm.py -k "cuda or device_slot" -p no:cacheprovider
if [ $SMOKE = 1 ]; then
  # no engine here: the generation step and the demo already start vLLM on the CPU, and the demo's
  # rounds go into it
  step "weight rounds (no vLLM on CPU)" 180 $PY bench/weight_sync.py --quick
else
  step "weight rounds into vLLM (~1B)" 420 $PY bench/weight_sync.py --layers $LAYERS --hidden $HIDDEN \
    --intermediate $INTER --reps 3
fi
step "killed member (gloo)" 180 $PY bench/killed_member.py --backend gloo --timeout 60
# one GPU: a weight-sync NCCL group whose peer never comes fails the round by its deadline, and the
# learner's process outlives the collective's timeout and the NCCL watchdog's pause (80 s)
if [ $SMOKE = 1 ]; then
  step "absent peer (gloo)" 60 $PY bench/absent_peer.py --backend gloo --deadline 3 --survive 2
else
  step "absent peer (nccl, the learner survives)" 180 $PY bench/absent_peer.py --backend nccl --deadline 5 --survive 80
fi
if [ $SMOKE = 1 ]; then
  skip "killed member (nccl)" "no GPU"
elif [ "$GPUS" -ge 3 ]; then
  step "killed member (nccl)" 300 $PY bench/killed_member.py --backend nccl --timeout 60
else
  skip "killed member (nccl)" "needs 3 GPUs, one per rank (NCCL refuses two ranks on one device); $GPUS here"
fi
gpu_step "vLLM V2 model runner" 300 env VLLM_USE_V2_MODEL_RUNNER=1 $PY -c "$RUNNER_PY" "$WORK/model" "$WORK/v2.json"
gpu_step "vLLM V1 model runner" 300 env VLLM_USE_V2_MODEL_RUNNER=0 $PY -c "$RUNNER_PY" "$WORK/model" "$WORK/v1.json"
if [ -s "$WORK/v2.json" ] && [ -s "$WORK/v1.json" ]; then
  $PY -c "$SAME_GREEDY_PY" "$WORK/v2.json" "$WORK/v1.json" >> "$LOG" 2>&1
fi
# sequence parallelism's all-to-all (learner.sequence_parallel): gloo on the CPU; NCCL where there are
# two GPUs (one per rank); the split forward, its gradient and the critic equal the whole sequence's
step "sequence parallel (gloo)" 180 $PY -m pytest -x -q tests/learner/test_sequence_parallel.py -k split_forward \
  -p no:cacheprovider
if [ $SMOKE = 1 ]; then
  skip "sequence parallel (nccl)" "no GPU"
elif [ "$GPUS" -ge 2 ]; then
  step "sequence parallel (nccl)" 180 env CONVEYOR_SP_BACKEND=nccl $PY -m pytest -x -q \
    tests/learner/test_sequence_parallel.py -k split_forward -p no:cacheprovider
else
  skip "sequence parallel (nccl)" "needs 2 GPUs, one per rank (NCCL refuses two ranks on one device); $GPUS here"
fi
# a mixture of experts end to end on the GPU (tests/system/test_moe.py: routes recorded by the worker
# extension's hook on vLLM's CUDA routers, weight rounds into the fused-MoE layers through
# load_weights, the engine and the learner agreeing at staleness 0, a LoRA run's merged rounds); the
# CPU suite runs the same test on the CPU build
gpu_step "MoE end to end (routing replay, rounds)" 420 $PY -m pytest -x -q tests/system/test_moe.py -p no:cacheprovider
# a vision-language policy (the tiny Qwen2-VL, fp32) on vLLM's CUDA engine: the engine's expansion of the
# image placeholders is the processor's, its greedy answers are transformers', its log-probs the
# learner's with the pixels; and the whole loop (tests/system/test_vision.py: rounds into the vision
# tower, a frozen tower left out). The CPU suite runs both on the CPU build.
gpu_step "vision-language engine (expansion, greedy, log-probs)" 300 $PY -m pytest -x -q tests/actors/test_vision.py \
  -k "expansion or greedy or behaviour_logprobs" -p no:cacheprovider
gpu_step "vision-language end to end" 600 $PY -m pytest -x -q tests/system/test_vision.py -p no:cacheprovider
step "demo ($STEPS steps, async)" 600 $PY -m launch.demo --learner.total_steps $STEPS --demo.warm_steps 0 \
  --demo.out "$WORK/demo"

{
  echo "=== summary"
  printf '%s\n' "${SUMMARY[@]}"
  echo "$PASSED passed, $FAILED failed, $SKIPPED skipped"
} | tee -a "$LOG"
[ $FAILED = 0 ]
