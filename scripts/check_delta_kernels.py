"""Hardware check of the chunked delta rule's Triton kernels, forward and backward, on a CUDA device.

    python scripts/check_delta_kernels.py                      # the shapes that faulted, and around them
    TRITON_INTERPRET=1 python scripts/check_delta_kernels.py --device cpu --lengths 100 --heads 1 --dims 16
    python scripts/check_delta_kernels.py --grad-precision tf32 --grad-block 32 --grad-warps 2   # a variant

Runs every case (tokens x heads x head dim x chunk x dtype), each kernel launch followed by a synchronize and a
printed line, so that an illegal memory access names its kernel and case (the last line printed). Values and the
gradients of every input are compared with the torch form (``delta_chunked``, float64). A case whose launch the
GPU refuses (shared memory: the gradient kernels at chunks of 128 with heads of 128 in float32) is reported and
skipped. Exit 0 when every other case passes: only then may ``hf_recattn.kernels`` register ``chunk_delta`` with
``backward_verified=True`` (the models run chunks of 64).

``--grad-precision``, ``--grad-block`` and ``--grad-warps`` run a variant of the two per-chunk gradient kernels
(their float32 tensor-core products in one TF32 pass, without tensor cores, or as three TF32 passes written out in
the kernel; 32 value columns per pass instead of 16; 2 warps per program, which compiles to per-warp products
instead of Hopper's warp-group ones): the candidate cures of the fault on Hopper GPUs, which a passing run shows.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from hf_recattn.kernels import delta
from hf_recattn.modeling.ops_delta import delta_chunked

KERNELS = ("_prepare_kernel", "_state_forward_kernel", "_output_kernel", "_local_value_grad_kernel",
           "_state_backward_kernel", "_query_grad_kernel", "_chunk_grad_kernel")
#: max |kernel - torch| / max |torch| per dtype of q, k, v (tf32x3 products in float32, one tf32 product in half)
RTOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2}
#: float32 inputs whose gradient kernels take one TF32 pass (``--grad-precision tf32``): 10 bits of mantissa
RTOL_ONE_TF32 = 1e-2


class _Synchronized:
    """A kernel whose every launch prints its name and synchronizes (so a fault surfaces at its own launch)."""

    def __init__(self, name: str, kernel: object, sync: Callable[[], None]) -> None:
        self.name, self.kernel, self.sync = name, kernel, sync

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: object, **kwargs: object) -> None:
            print(f"  {self.name} grid {grid}", flush=True)
            self.kernel[grid](*args, **kwargs)
            self.sync()

        return launch


def _inputs(h: int, t: int, d: int, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(t * h + d)
    x = {"q": torch.randn(1, h, t, d, generator=gen), "k": F.normalize(torch.randn(1, h, t, d, generator=gen), dim=-1),
         "v": torch.randn(1, h, t, d, generator=gen), "log_alpha": -torch.rand(1, h, t, generator=gen),
         "beta": torch.rand(1, h, t, generator=gen), "erase": torch.rand(1, h, t, generator=gen),
         "initial_state": torch.randn(1, h, d, d, generator=gen)}
    return {n: a.to(device, dtype if n in "qkv" else torch.float32).requires_grad_() for n, a in x.items()}


def _run(x: dict[str, torch.Tensor], kernel: bool, chunk: int) -> list[torch.Tensor]:
    """o, final state and the gradients of every input under fixed random upstream gradients."""
    if kernel:
        o, final = delta.chunk_delta_rule(**x, output_final_state=True, chunk_size=chunk)
    else:
        y = {n: a.double() for n, a in x.items()}
        o, final = delta_chunked(y["q"].unsqueeze(2), y["k"], y["v"], y["log_alpha"], y["beta"], y["erase"],
                                 y["initial_state"], chunk)
        o = o[:, :, 0]
    gen = torch.Generator().manual_seed(1)
    do, dsn = (torch.randn(a.shape, generator=gen).to(a.device, a.dtype) for a in (o, final))
    grads = torch.autograd.grad([o, final], list(x.values()), [do, dsn])
    return [o, final, *grads]


def check(t: int, h: int, d: int, chunk: int, dtype: torch.dtype, device: str) -> float:
    """The worst relative error of one case (outputs, final state, every gradient)."""
    x = _inputs(h, t, d, dtype, device)
    got, ref = _run(x, True, chunk), _run(x, False, chunk)
    errors = [(a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30) for a, b in zip(got, ref, strict=True)]
    return max(e.item() for e in errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 1000, 4096])
    parser.add_argument("--heads", type=int, nargs="+", default=[9, 1, 32])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 16, 128])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--grad-precision", choices=delta.PRECISIONS, default=delta.GRAD_FLOAT32_PRECISION,
                        help="float32 products of the per-chunk gradient kernels on CUDA")
    parser.add_argument("--grad-block", type=int, choices=delta.GRAD_BLOCKS, default=delta.BLOCK_V_GRAD,
                        help="value columns per pass of the per-chunk gradient kernels")
    parser.add_argument("--grad-warps", type=int, choices=delta.GRAD_WARP_COUNTS, default=delta.GRAD_WARPS,
                        help="warps per program of the per-chunk gradient kernels (2: no warp-group products)")
    args = parser.parse_args(argv)
    delta.set_gradient_variant(args.grad_precision, args.grad_block, args.grad_warps)
    rtol = {**RTOL, torch.float32: RTOL_ONE_TF32} if args.grad_precision == "tf32" else RTOL
    print(f"gradient kernels: float32 products {args.grad_precision}, {args.grad_block} value columns per pass, "
          f"{args.grad_warps} warps")
    if args.device == "cuda":  # (the interpreter runs launches one after the other anyway)
        for name in KERNELS:
            setattr(delta, name, _Synchronized(name, getattr(delta, name), torch.cuda.synchronize))
    failed = unfit = 0
    for t, h, d, chunk, dtype in itertools.product(args.lengths, args.heads, args.dims, args.chunks, args.dtypes):
        print(f"T={t} heads={h} dim={d} chunk={chunk} {dtype}", flush=True)
        try:
            err = check(t, h, d, chunk, getattr(torch, dtype), args.device)
        except OutOfResources as error:  # refused at launch (e.g. chunks of 128 with heads of 128): no fault
            unfit += 1
            print(f"  does not fit this GPU: {error}", flush=True)
            continue
        ok = err <= rtol[getattr(torch, dtype)]
        failed += not ok
        print(f"  {'ok' if ok else 'FAIL'}: worst relative error {err:.2e}", flush=True)
    print(("all cases pass" if not failed else f"{failed} cases fail") + (f"; {unfit} do not fit" if unfit else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
