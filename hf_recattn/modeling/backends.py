"""Which implementation runs an op: the torch forms of this folder, or a Triton kernel registered for it.

The kernels live in the installed package (``hf_recattn.kernels``) and register themselves here when triton
imports. A checkpoint loaded with ``trust_remote_code`` where the package is not installed has no kernels and runs
the torch forms, which compute the same function.

The choice, set with the ``HF_RECATTN_KERNELS`` environment variable or ``use_kernels(...)``:

* ``auto`` (default): the kernel for CUDA tensors of a dtype it supports, the torch forms otherwise. A CUDA call
  the kernel cannot take (say float64) runs on torch after one warning. A kernel registered with an unverified
  backward (one that has not passed its check on GPU hardware) runs only where no gradient is asked for: a call
  that records gradients runs the torch form, whose backward is the torch one.
* ``triton``: the kernel for every call, CPU tensors included (Triton runs those only under ``TRITON_INTERPRET=1``,
  for tests), unverified backwards included; a call it cannot take, or a kernel that is not there, is an error.
  ``check_mode`` refuses it up front where it cannot run at all (no triton, no CUDA device nor interpreter).
* ``torch``: never a kernel.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

MODES = ("auto", "triton", "torch")
ENV = "HF_RECATTN_KERNELS"
#: dtypes every kernel takes (they accumulate in float32)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: the device types on which ``auto`` picks a kernel
KERNEL_DEVICES = ("cuda",)

_kernels: dict[str, Callable] = {}
#: ops whose kernel's backward has not passed its GPU check: ``auto`` runs their torch form when gradients are on
_unverified_backward: set[str] = set()
_loader: Callable[[], None] | None = None
_override = threading.local()
_warned: set[tuple[str, str]] = set()


def register(name: str, fn: Callable, backward_verified: bool = True) -> None:
    """Make ``fn`` the kernel for the op ``name`` (called by ``hf_recattn.kernels`` at import).

    ``backward_verified=False``: its backward has not passed its GPU check, so ``auto`` does not run it.
    """
    _kernels[name] = fn
    if backward_verified:
        _unverified_backward.discard(name)
    else:
        _unverified_backward.add(name)


def set_loader(load: Callable[[], None]) -> None:
    """``load()`` imports and registers the kernels; it runs once, the first time a call may use one (so that
    ``import hf_recattn`` does not import triton)."""
    global _loader
    _loader = load


def _load() -> None:
    global _loader
    load, _loader = _loader, None
    if load is not None:
        load()


def registered() -> list[str]:
    _load()
    return sorted(_kernels)


def mode() -> str:
    """The current choice: ``use_kernels``'s if one is active, else ``HF_RECATTN_KERNELS``, else ``auto``."""
    chosen = getattr(_override, "mode", None) or os.environ.get(ENV, "auto")
    if chosen not in MODES:
        raise ValueError(f"{ENV}={chosen!r}: choose one of {', '.join(MODES)}")
    return chosen


def _refuse_unrunnable(chosen: str, setting: str) -> None:
    """ValueError naming ``setting`` if ``chosen`` is ``triton`` where kernels cannot run at all: triton not
    installed (no kernel registered), or neither a CUDA device nor Triton's interpreter."""
    if chosen != "triton":
        return
    if not registered():
        raise ValueError(f"{setting} but no Triton kernel is registered (is triton installed? "
                         'pip install "hf-recattn[kernels]")')
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{setting} needs a CUDA device, or TRITON_INTERPRET=1 set before triton is imported "
                         "(Triton's interpreter, for tests on the CPU)")


def check_mode() -> str:
    """The current choice (``mode()``), refused up front where it cannot run at all: call it before any work."""
    chosen = mode()
    override = getattr(_override, "mode", None)
    _refuse_unrunnable(chosen, f"use_kernels({override!r})" if override else f"{ENV}={chosen}")
    return chosen


@contextmanager
def use_kernels(choice: str) -> Iterator[None]:
    """Run the block with kernels chosen as ``choice`` (``auto``, ``triton`` or ``torch``) in this thread; a choice
    this machine cannot run is refused on entry."""
    if choice not in MODES:
        raise ValueError(f"use_kernels({choice!r}): choose one of {', '.join(MODES)}")
    _refuse_unrunnable(choice, f"use_kernels({choice!r})")
    previous = getattr(_override, "mode", None)
    _override.mode = choice
    try:
        yield
    finally:
        _override.mode = previous


def _unsupported(tensors: tuple[torch.Tensor, ...], extra: str | None) -> str | None:
    """Why the kernels cannot take these tensors, or None."""
    if extra:
        return extra
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return f"tensors on several devices {sorted(map(str, devices))}"
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    bad = sorted(str(d) for d in dtypes if d not in KERNEL_DTYPES)
    if bad:
        return f"dtype {', '.join(bad)} (kernels take {', '.join(str(d) for d in KERNEL_DTYPES)})"
    return None


def _records_gradients(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether autograd records this call (a backward may follow)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def pick(name: str, *tensors: torch.Tensor | None, unsupported: str | None = None) -> Callable | None:
    """The kernel to run op ``name`` on these tensors, or None for the torch form.

    ``unsupported`` is the caller's reason the kernel cannot take this call (an option it lacks), if any.
    """
    chosen = mode()
    if chosen == "torch":
        return None
    present = tuple(t for t in tensors if t is not None)
    on_kernel_device = bool(present) and all(t.device.type in KERNEL_DEVICES for t in present)
    if chosen == "auto" and not on_kernel_device:
        return None
    _load()
    kernel = _kernels.get(name)
    reason = _unsupported(present, unsupported)
    if chosen == "triton":
        on_cpu = any(t.device.type == "cpu" for t in present)
        if reason is None and on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
            reason = "CPU tensors outside Triton's interpreter (set TRITON_INTERPRET=1 before triton is imported)"
        if kernel is None:
            raise ValueError(
                f"{ENV}=triton but no Triton kernel is registered for {name!r} (is triton installed, and "
                "hf_recattn.kernels importable?)"
            )
        if reason is not None:
            raise ValueError(f"{ENV}=triton: the {name!r} kernel cannot take {reason}")
        return kernel
    if kernel is None or (name in _unverified_backward and _records_gradients(present)):
        return None
    if reason is not None:
        if (name, reason) not in _warned:
            _warned.add((name, reason))
            warnings.warn(f"the Triton kernel for {name!r} cannot take {reason}; running the torch form",
                          stacklevel=3)
        return None
    return kernel
