"""Hardware check of the loss on Liger Kernel's fused ops (``training/fused_loss.py``) against the torch form, on CUDA.

    python scripts/check_fused_loss.py                    # SmolLM2's and Qwen3's head shapes, float32 and bfloat16
    TRITON_INTERPRET=1 python scripts/check_fused_loss.py --device cpu --shapes 64,32,100 --dtypes float32

For each case (head shape x dtype x loss x temperature; the cross-entropy also with the final soft-cap and with
per-position weights, which the interpreter cannot run and does not, respectively, cover in the tests), the loss and
its gradients w.r.t. the hidden states and the LM head's weight, on the Liger ops (``fused_loss_sum``) and on the
torch form over the whole logits (``distill_loss_sum``): their max difference over the torch form's largest
magnitude, and on CUDA each form's peak memory above the inputs and its time (median of 3, synchronized). In
bfloat16 both are also compared with the torch form in float32 (``vs fp32``), to tell rounding from a fault.
Exit 0 when every case is within RTOL of its dtype.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from torch import nn

from hf_recattn.training.distill_loss import distill_loss_sum
from hf_recattn.training.fused_loss import fused_loss_sum
from hf_recattn.training.lm_outputs import final_logits

#: max |liger - torch| / max |torch| per dtype (float32: summation order; bfloat16: the logits' rounding, which the
#: torch form does in bfloat16 and Liger's KL in float32)
RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
#: (loss, temperature, soft-cap, weighted) per case
CASES = [("ce", 1.0, None, False), ("ce", 1.0, 30.0, False), ("ce", 1.0, None, True), ("kl", 1.0, None, False),
         ("kl", 2.0, None, False), ("ce+kl", 1.0, None, False), ("ce+kl", 2.0, None, False)]


class _Head(nn.Module):
    """The LM-head end of a causal LM, as ``fused_loss`` and ``final_logits`` read it."""

    def __init__(self, hidden: int, vocab: int, softcap: float | None, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        nn.init.normal_(self.lm_head.weight, std=hidden**-0.5)
        self.config = SimpleNamespace(logits_scaling=None, final_logit_softcapping=softcap)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def _inputs(tokens: int, hidden: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(tokens + hidden)
    labels = torch.randint(0, 1 << 30, (1, tokens), generator=gen)
    labels[0, torch.rand(tokens, generator=gen) < 0.1] = -100  # a tenth of the positions not predicted
    x = {"hidden": 2 * torch.randn(1, tokens, hidden, generator=gen), "labels": labels,
         "teacher_hidden": 2 * torch.randn(1, tokens, hidden, generator=gen),
         "weights": torch.rand(1, tokens, generator=gen) * 3}
    return {n: a.to(device, dtype if "hidden" in n else a.dtype) for n, a in x.items()}


def _timed(step: object, device: str) -> tuple[list[torch.Tensor], float, float]:
    """``step()``'s outputs, its peak memory above what was allocated before (GB) and its median time (ms)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, peak = [], 0.0
    for _ in range(3):
        sync()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        began = time.perf_counter()
        out = step()
        sync()
        times.append(1000 * (time.perf_counter() - began))
        if device == "cuda":
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return out, peak, statistics.median(times)


def _run(student: _Head, teacher: _Head, x: dict, case: tuple, fused: bool) -> list[torch.Tensor]:
    """The loss and the gradients of the hidden states and the student's head, on one form."""
    loss, temperature, _, weighted = case
    student.zero_grad()
    h = x["hidden"].detach().requires_grad_()
    labels, weights = x["labels"] % student.lm_head.out_features, x["weights"] if weighted else None
    if fused:
        total, _ = fused_loss_sum(student, h, labels, teacher, x["teacher_hidden"], loss, temperature, 0.5, weights)
    else:
        with torch.no_grad():
            teacher_logits = final_logits(teacher, x["teacher_hidden"]) if loss != "ce" else None
        total, _ = distill_loss_sum(final_logits(student, h), labels, teacher_logits, loss, temperature, 0.5, weights)
    total.backward()
    return [total.detach().float(), h.grad.float(), student.lm_head.weight.grad.float()]


def _error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(got, want, strict=True))


def check(shape: tuple[int, int, int], dtype: torch.dtype, case: tuple, device: str) -> float:
    """Print one case's line; return the worst relative difference of the Liger form from the torch form."""
    tokens, hidden, vocab = shape
    student = _Head(hidden, vocab, case[2], 0).to(device, dtype)
    teacher = _Head(hidden, vocab, None, 1).to(device, dtype)
    x = _inputs(tokens, hidden, device, dtype)
    got, fused_gb, fused_ms = _timed(lambda: _run(student, teacher, x, case, True), device)
    want, torch_gb, torch_ms = _timed(lambda: _run(student, teacher, x, case, False), device)
    err = _error(got, want)
    line = f"  {case[0]:5} T={case[1]:g} softcap={case[2]} weighted={case[3]}: liger vs torch {err:.2e}"
    if dtype != torch.float32:
        x32 = {n: a.float() if a.is_floating_point() else a for n, a in x.items()}
        exact = _run(student.float(), teacher.float(), x32, case, False)
        line += f" (vs fp32: liger {_error(got, exact):.2e}, torch {_error(want, exact):.2e})"
    if device == "cuda":
        line += f"; peak GB liger {fused_gb:.2f} torch {torch_gb:.2f}; ms liger {fused_ms:.1f} torch {torch_ms:.1f}"
    ok = err <= RTOL[dtype]
    print(("    ok" if ok else "    FAIL") + line[1:], flush=True)
    return err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", nargs="+", default=["4096,576,49152", "4096,1024,151936"],
                        help="tokens,hidden,vocab of each head")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    cases = [c for c in CASES if args.device == "cuda" or c[2] is None]  # the interpreter has no soft-cap (tests)
    failed = 0
    for spec, name in itertools.product(args.shapes, args.dtypes):
        shape, dtype = tuple(int(n) for n in spec.split(",")), getattr(torch, name)
        print(f"tokens={shape[0]} hidden={shape[1]} vocab={shape[2]} {name}", flush=True)
        for case in cases:
            failed += check(shape, dtype, case, args.device) > RTOL[dtype]
    print("all cases pass" if not failed else f"{failed} cases fail")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
