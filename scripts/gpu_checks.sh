#!/usr/bin/env bash
# Every GPU check and GPU benchmark of the project in one run, on a machine with one CUDA device.
#
#   bash scripts/gpu_checks.sh [OUT_DIR] [SECONDS]     # defaults: gpu-results, 540
#
# In order (each step gets at most what is left of SECONDS, so that the run ends in time; skipped when too little
# is left):
#   1. scripts/check_delta_kernels.py at the shapes that once faulted: the Triton delta rule, forward and backward,
#      against the float64 torch form. If it fails, the candidate cures run at the first failing case, each a
#      variant of the two per-chunk gradient kernels (2 warps per program, which compiles to per-warp products
#      instead of Hopper's warp-group ones; float32 products as three TF32 passes written out in the kernel; 32
#      value columns per pass; products without tensor cores or in one TF32 pass), then two variants of the
#      compiler (warp-group products switched off; DELTA_PTXAS: another ptxas). The first of the package's own variants that passes
#      there runs again at every shape of step 1; if it passes, that variant is the one timed in step 2 and the
#      summary names it. DELTA_SANITIZER=1 also runs the failing case under compute-sanitizer (memcheck).
#   2. benchmarks/kernel_speed.py --device cuda at 2k-32k tokens, fp32: ours (Triton, and the torch forms),
#      transformers' torch gated delta rule, SDPA, flash-linear-attention (when it imports); the Triton delta
#      backward only when step 1 passed (with the variant that passed).
#   3. benchmarks/conversion_scale.py --device cuda for Qwen3-8B, 0.6B and 1.7B shapes, both stages.
#   4. scripts/check_fused_loss.py: the loss on Liger Kernel's fused ops against the torch form.
#   5. benchmarks/kernel_speed.py again in bf16, if time is left.
# GPU_SKIP names steps not to run (e.g. GPU_SKIP="conversion_scale fused_loss").
# Logs and result files go to OUT_DIR; the summary (each step's exit code and seconds) to OUT_DIR/summary.txt.
set -u
out=${1:-gpu-results}
budget=${2:-540}
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

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$python" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
} | tee "$out/summary.txt"

delta=(--lengths 2048 1000 --heads 9 32 --dims 64 128 --chunks 64 --dtypes float32 bfloat16)
check=("$python" scripts/check_delta_kernels.py)
variant=()  # the gradient kernels' variant that passed: precision, value block, warps (empty: the defaults)
if step check_delta 120 "${check[@]}" "${delta[@]}"; then
    delta_ok=1
else
    delta_ok=0
    failing=(--lengths 2048 --heads 9 --dims 64 --chunks 64 --dtypes float32)
    if [[ ${DELTA_SANITIZER:-0} == 1 ]]; then
        step delta_sanitizer 90 compute-sanitizer --tool memcheck --print-limit 10 "${check[@]}" "${failing[@]}"
    fi
    cure=""
    for candidate in "tf32x3 16 2" "split 16 8" "tf32x3 32 8" "ieee 16 8" "tf32 16 8"; do
        read -r precision block warps <<<"$candidate"
        if step "delta_${precision}_${block}_${warps}" 45 "${check[@]}" "${failing[@]}" --grad-precision "$precision" \
            --grad-block "$block" --grad-warps "$warps" && [[ -z $cure ]]; then
            cure=$candidate
        fi
    done
    step delta_no_wgmma 45 env DISABLE_MMA_V3=1 "${check[@]}" "${failing[@]}"
    if [[ -n ${DELTA_PTXAS:-} ]]; then
        step delta_ptxas 45 env TRITON_PTXAS_PATH="$DELTA_PTXAS" "${check[@]}" "${failing[@]}"
    fi
    if [[ -n $cure ]]; then
        read -r precision block warps <<<"$cure"
        if step delta_cure 120 "${check[@]}" "${delta[@]}" --grad-precision "$precision" \
            --grad-block "$block" --grad-warps "$warps"; then
            delta_ok=1
            variant=(--delta-grad "$precision" "$block" "$warps")
            echo "delta backward cure: --grad-precision $precision --grad-block $block --grad-warps $warps" \
                | tee -a "$out/summary.txt"
        fi
    fi
fi

impls=("ours gdr" "ours gdr torch" "hf gdr" sdpa "ours linear")
fla_probe='import torch; from fla.ops.gated_delta_rule import chunk_gated_delta_rule as f
x = [torch.randn(1, 128, 2, 64, device="cuda", requires_grad=True) for _ in range(3)]
g, b = torch.randn(1, 128, 2, device="cuda").sigmoid().log(), torch.rand(1, 128, 2, device="cuda")
f(*x, g, b, use_qk_l2norm_in_kernel=True)[0].sum().backward()'
fla=none
if "$python" -c "import fla.ops.gated_delta_rule" 2>/dev/null; then
    impls+=("fla gdr")
    fla=fwd
    "$python" -c "$fla_probe" >"$out/fla_probe.log" 2>&1 && fla=both
fi
echo "flash-linear-attention: $fla" | tee -a "$out/summary.txt"
speed=(--device cuda --lengths 2048 4096 8192 16384 32768 --repeats 3 --warmup 1 --impls "${impls[@]}" "${variant[@]}")
if [[ $fla == fwd ]]; then
    speed+=(--leave-out "fla gdr/fwd+bwd" --note "fla gdr fwd+bwd: left out, fla's backward failed on this GPU \
($(tail -n 1 "$out/fla_probe.log" | cut -c1-200)).")
fi
if ((delta_ok == 0)); then
    speed+=(--leave-out "ours gdr/fwd+bwd" --note "ours gdr fwd+bwd: left out, the Triton delta backward failed \
scripts/check_delta_kernels.py on this GPU; ours gdr torch (the torch forms) runs it.")
fi
step kernel_speed 150 "$python" benchmarks/kernel_speed.py "${speed[@]}" --out "$out/kernel_speed_cuda.json"

step conversion_scale 300 "$python" benchmarks/conversion_scale.py --device cuda --steps 3 \
    --gpu-sizes Qwen3-8B Qwen3-0.6B Qwen3-1.7B --out "$out/conversion_scale_cuda.json"

step fused_loss 90 "$python" scripts/check_fused_loss.py

step kernel_speed_bf16 120 "$python" benchmarks/kernel_speed.py "${speed[@]}" --dtype bfloat16 \
    --out "$out/kernel_speed_cuda_bf16.json"
echo "delta backward verified on this GPU: $delta_ok" | tee -a "$out/summary.txt"
