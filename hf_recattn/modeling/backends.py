"""Which implementation runs an op: the torch forms of this folder, or fla's kernel for it (``fla_adapters.py``).

fla (flash-linear-attention, ``pip install "hf-recattn[fla]"``) is imported the first time a call could use it;
without it every op runs its torch form, which computes the same function. This folder ships beside checkpoints,
so a checkpoint loaded with ``trust_remote_code`` uses fla wherever fla is installed.

The choice, set with the ``HF_RECATTN_KERNELS`` environment variable or ``use_kernels(...)``:

* ``auto`` (default): fla's kernel for CUDA tensors of a dtype it takes, the torch forms otherwise. A CUDA call
  fla cannot take (a float64 tensor, a recurrence fla does not compute) runs on torch after one warning. Until a
  GPU run has verified fla's backward through these adapters (``scripts/gpu_checks.sh``), every op is registered
  with an unverified backward: a call that records gradients runs the torch form, whose backward is the torch one.
* ``fla``: fla's kernel for every call it covers, gradients included; a computation fla does not cover warns once
  and runs the torch form, and a call on tensors fla's kernels cannot run on (the CPU) is an error.
  ``check_mode`` refuses it up front where it cannot run at all (fla not importable, no CUDA device).
* ``torch``: never a kernel.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .fla_adapters import load_fla

MODES = ("auto", "fla", "torch")
ENV = "HF_RECATTN_KERNELS"
#: dtypes every kernel takes (they accumulate in float32)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: the device types on which fla's kernels run
KERNEL_DEVICES = ("cuda",)

_kernels: dict[str, Callable] = {}
#: ops whose kernel's backward has not passed its GPU check: ``auto`` runs their torch form when gradients are on
_unverified_backward: set[str] = set()
_loaded = False
_override = threading.local()
_warned: set[tuple[str, str]] = set()


def register(name: str, fn: Callable, backward_verified: bool = True) -> None:
    """Make ``fn`` the kernel for the op ``name``.

    ``backward_verified=False``: its backward has not passed its GPU check, so ``auto`` does not train with it.
    """
    _kernels[name] = fn
    if backward_verified:
        _unverified_backward.discard(name)
    else:
        _unverified_backward.add(name)


def _load() -> None:
    """Register fla's functions, once (the first time a call may use one: ``import hf_recattn`` imports no fla)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name, fn in load_fla().items():
        if name not in _kernels:  # a kernel registered by hand (tests) stays
            register(name, fn, backward_verified=False)


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
    """ValueError naming ``setting`` if ``chosen`` is ``fla`` where fla cannot run at all: fla not importable (no
    kernel registered), or no CUDA device."""
    if chosen != "fla":
        return
    if not registered():
        raise ValueError(f'{setting} but fla does not import (pip install "hf-recattn[fla]")')
    if not torch.cuda.is_available():
        raise ValueError(f"{setting} needs a CUDA device (fla's kernels do not run on the CPU)")


def check_mode() -> str:
    """The current choice (``mode()``), refused up front where it cannot run at all: call it before any work."""
    chosen = mode()
    override = getattr(_override, "mode", None)
    _refuse_unrunnable(chosen, f"use_kernels({override!r})" if override else f"{ENV}={chosen}")
    return chosen


@contextmanager
def use_kernels(choice: str) -> Iterator[None]:
    """Run the block with kernels chosen as ``choice`` (``auto``, ``fla`` or ``torch``) in this thread; a choice
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


def _warn_once(name: str, reason: str) -> None:
    if (name, reason) not in _warned:
        _warned.add((name, reason))
        warnings.warn(f"fla's {name!r} cannot take {reason}; running the torch form", stacklevel=4)


def pick(name: str, *tensors: torch.Tensor | None, unsupported: str | None = None) -> Callable | None:
    """fla's kernel to run op ``name`` on these tensors, or None for the torch form.

    ``unsupported`` is the caller's reason fla cannot take this call (a recurrence or an option it lacks), if any.
    """
    chosen = mode()
    if chosen == "torch":
        return None
    present = tuple(t for t in tensors if t is not None)
    on_kernel_device = bool(present) and all(t.device.type in KERNEL_DEVICES for t in present)
    if chosen == "auto" and not on_kernel_device:
        return None
    if chosen == "fla" and not on_kernel_device:
        raise ValueError(f"{ENV}=fla: fla's {name!r} runs on CUDA tensors, not on "
                         f"{sorted({t.device.type for t in present})}")
    _load()
    kernel = _kernels.get(name)
    if kernel is None:
        if chosen == "fla":
            raise ValueError(f'{ENV}=fla but fla has no {name!r} here (pip install "hf-recattn[fla]")')
        return None
    reason = _unsupported(present, unsupported)
    if reason is not None:
        _warn_once(name, reason)
        return None
    if chosen == "auto" and name in _unverified_backward and _records_gradients(present):
        return None
    return kernel
