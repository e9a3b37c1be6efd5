#!/usr/bin/env bash
# Every GPU check and GPU benchmark of the project in one run, on a machine with one CUDA device.
#
#   bash scripts/gpu_checks.sh [OUT_DIR] [SECONDS]     # defaults: gpu-results, 540
#
# In order (each step gets at most what is left of SECONDS, so that the run ends in time; skipped when too little
# is left):
#   1. scripts/check_delta_kernels.py at the shapes that once faulted: the Triton delta rule, forward and backward,
#      against the float64 torch form. If it fails, the first case runs again under compute-sanitizer (memcheck),
#      whose report names the kernel and source line of an out-of-bounds access, and then the candidate cures
#      run at that case: 32 value columns per pass in the gradient kernels, their float32 products without
#      tensor cores or in one TF32 pass, and (when DELTA_PTXAS names a newer ptxas) that ptxas; the summary says
#      which pass.
#   2. benchmarks/kernel_speed.py --device cuda at 2k-32k tokens, fp32: ours (Triton, and the torch forms),
#      transformers' torch gated delta rule, SDPA, flash-linear-attention (when it imports); the Triton delta
#      backward only when step 1 passed.
#   3. benchmarks/conversion_scale.py --device cuda for Qwen3-8B, 0.6B and 1.7B shapes, both stages.
#   4. scripts/check_fused_loss.py: the loss on Liger Kernel's fused ops against the torch form.
#   5. benchmarks/kernel_speed.py again in bf16, if time is left.
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
if step check_delta 120 "$python" scripts/check_delta_kernels.py "${delta[@]}"; then
    delta_ok=1
else
    delta_ok=0
    failing=(--lengths 2048 --heads 9 --dims 64 --chunks 64 --dtypes float32)
    step delta_sanitizer 90 compute-sanitizer --tool memcheck --print-limit 10 \
        "$python" scripts/check_delta_kernels.py "${failing[@]}"
    step delta_block32 40 "$python" scripts/check_delta_kernels.py "${failing[@]}" --grad-block 32
    step delta_ieee 40 "$python" scripts/check_delta_kernels.py "${failing[@]}" --grad-precision ieee
    step delta_tf32 40 "$python" scripts/check_delta_kernels.py "${failing[@]}" --grad-precision tf32
    if [[ -n ${DELTA_PTXAS:-} ]]; then
        step delta_ptxas 60 env TRITON_PTXAS_PATH="$DELTA_PTXAS" "$python" scripts/check_delta_kernels.py "${failing[@]}"
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
speed=(--device cuda --lengths 2048 4096 8192 16384 32768 --repeats 3 --warmup 1 --impls "${impls[@]}")
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
