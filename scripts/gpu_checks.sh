#!/usr/bin/env bash
# Every GPU check and GPU benchmark of the project in one run, on a machine with one CUDA device, within SECONDS.
# On a fresh machine Triton compiles fla's autotuned kernels first: on an H200 each case of step 1 took 15-40 s, so
# the whole of step 1 needs far more than its 240 s (docs/speed.md); GPU_FLA_SELECT narrows it.
#
#   bash scripts/gpu_checks.sh [OUT_DIR] [SECONDS]     # defaults: gpu-results, 480
#
# Wheels: the machine may have no network. Whatever wheels lie in .wheels/ (ignored by git) are installed first,
# without an index and without their dependencies. Fill it where pip reaches an index:
#
#   pip download --no-deps -d .wheels "fla-core==0.6.0" einops     # fla and its one requirement (pure Python)
#
# and, for a machine without them, the project's requirements (a CUDA build of torch brings triton). PYTHON names the
# interpreter (default python3).
#
# In order (each step gets at most what is left of SECONDS, so that the run ends in time; skipped when too little
# is left):
#   1. fla_equality: tests/test_fla_gpu.py, fla's kernels through modeling/fla_adapters.py against the torch forms
#      (values and gradients; float32 and bfloat16; 64 / 1000 / 4096 tokens; decode steps; tiny models on packed
#      documents) for every computation fla covers. When it passes, fla's backward is verified on this GPU.
#   2. kernel_speed: benchmarks/kernel_speed.py --device cuda at 2k-32k tokens, fp32, forward and forward+backward:
#      ours through fla (forced), transformers' torch gated delta rule, SDPA, our linear attention through fla and
#      fla's kernel called directly.
#   3. fused_loss: scripts/check_fused_loss.py, the loss on Liger Kernel's fused ops against the torch form.
#   4. conversion_scale: benchmarks/conversion_scale.py --device cuda for Qwen3 shapes, both stages.
#   5. kernel_speed_bf16: step 2 in bf16, if time is left.
# GPU_SKIP names steps not to run (e.g. GPU_SKIP="conversion_scale fused_loss"). GPU_FLA_SELECT is a pytest -k
# expression choosing the cases of step 1 (e.g. "float32 and not 1000 and not 4096"); fla's backward then counts as
# verified for those cases only.
# Logs and result files go to OUT_DIR; the summary (each step's exit code and seconds) to OUT_DIR/summary.txt.
set -u
out=${1:-gpu-results}
budget=${2:-480}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
deadline=$((SECONDS + budget))

step() {  # step NAME MAX_SECONDS COMMAND...: run with a time limit, log to OUT_DIR/NAME.log
    local name=$1 limit=$2 left=$((deadline - SECONDS - 5))
    shift 2
    if [[ " ${GPU_SKIP:-} " == *" $name "* ]]; then
        echo "$name: skipped (GPU_SKIP)" | tee -a "$out/summary.txt"
        return 98
    fi
    if ((left < 20)); then
        echo "$name: skipped (${left} s left)" | tee -a "$out/summary.txt"
        return 99
    fi
    ((limit > left)) && limit=$left
    local start=$SECONDS
    echo "=== $name (limit ${limit} s)"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
    tail -n 25 "$out/$name.log"
    return $rc
}

if compgen -G ".wheels/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps .wheels/*.whl >"$out/wheels.log" 2>&1 \
        || echo "wheels: install failed (see wheels.log)" | tee -a "$out/summary.txt"
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$python" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
    "$python" -c "import fla; print('fla', fla.__version__)" 2>/dev/null || echo "fla: does not import"
} | tee "$out/summary.txt"

verified=0
# every case runs (no -x), so one run names each computation that fails; a run that skipped a case (fla not
# importable, no CUDA device) verifies nothing
select=()
[[ -n "${GPU_FLA_SELECT:-}" ]] && select=(-k "$GPU_FLA_SELECT")
# -v names each case as it ends, and each failure prints its reason at once (tests/test_fla_gpu.py), so a step
# stopped at its limit still says what ran
step fla_equality 240 "$python" -m pytest -v -rfEs -p no:cacheprovider "${select[@]}" tests/test_fla_gpu.py \
    && verified=1
grep -Eq "[0-9]+ skipped" "$out/fla_equality.log" && verified=0

speed=(--device cuda --lengths 2048 4096 8192 16384 32768 --repeats 3 --warmup 1
       --impls "ours gdr" "ours gdr torch" "hf gdr" sdpa "ours linear" "fla gdr")
if ((verified == 0)); then
    speed+=(--leave-out "ours gdr/fwd+bwd" "fla gdr/fwd+bwd" --note "fla fwd+bwd: left out, tests/test_fla_gpu.py \
failed on this GPU; ours gdr torch (the torch forms) runs it.")
fi
step kernel_speed 130 "$python" benchmarks/kernel_speed.py "${speed[@]}" --out "$out/kernel_speed_cuda.json"

step fused_loss 60 "$python" scripts/check_fused_loss.py

step conversion_scale 120 "$python" benchmarks/conversion_scale.py --device cuda --steps 3 \
    --gpu-sizes Qwen3-0.6B Qwen3-1.7B --out "$out/conversion_scale_cuda.json"

step kernel_speed_bf16 100 "$python" benchmarks/kernel_speed.py "${speed[@]}" --dtype bfloat16 \
    --out "$out/kernel_speed_cuda_bf16.json"
echo "fla backward verified on this GPU: $verified" | tee -a "$out/summary.txt"
