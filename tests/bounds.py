"""Bounds checks for Triton kernels run through Triton's interpreter (``TRITON_INTERPRET=1``).

``checked_memory()`` makes every interpreted ``tl.load`` / ``tl.store`` check its unmasked lanes: each one must
fall, whole, inside the extent of one tensor argument of the kernel launch, and all the lanes of one access inside
the same tensor. A GPU reports such an access as an illegal memory access (or silently reads a neighbour); the
interpreter reads host memory and does not notice, so without this check the tests cannot catch it.

A violation raises ``OutOfBounds`` naming the kernel, load or store, the bytes accessed and the nearest tensor
argument (by parameter name). Extents are those of the launch's CPU tensors (the interpreter runs on their own
memory; it would copy CUDA tensors to the host). Not checked: atomics, tensor descriptors, block pointers (the
project's kernels use none).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from triton.runtime import interpreter
from triton.runtime.errors import InterpreterError

#: marks a test that needs the kernels interpreted (skipped where they run compiled, on a GPU)
interpreted_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="the bounds check runs kernels through Triton's interpreter")


class OutOfBounds(AssertionError):
    """An unmasked lane of a load or store outside every tensor argument of its launch."""


def _extent(x: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] that x's elements occupy."""
    if x.numel() == 0:
        return x.data_ptr(), x.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(x.shape, x.stride(), strict=True))
    return x.data_ptr(), x.data_ptr() + (last + 1) * x.element_size()


class _Checker:
    def __init__(self) -> None:
        self.kernel = ""
        self.extents: list[tuple[str, int, int]] = []
        self.accesses = 0

    def launch(self, name: str, params: list[str], args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        self.kernel = name
        named = list(zip(params, args, strict=False)) + list(kwargs.items())
        self.extents = [(arg, *_extent(x)) for arg, x in named if isinstance(x, torch.Tensor)]

    def check(self, kind: str, ptrs: object, mask: object) -> None:
        self.accesses += 1
        addresses = np.asarray(ptrs.data, dtype=np.uint64)
        active = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
        if not active.any():
            return
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        lo, hi = int(addresses[active].min()), int(addresses[active].max()) + size
        if any(start <= lo and hi <= end for _, start, end in self.extents):
            return
        raise OutOfBounds(f"{self.kernel}: {kind} of bytes [{lo:#x}, {hi:#x}) is not inside one tensor argument; "
                          f"nearest: {self._nearest(lo, hi)}")

    def _nearest(self, lo: int, hi: int) -> str:
        """The tensor argument the access starts in (else the closest one), and where the access lies against it."""
        if not self.extents:
            return "none (the launch has no tensor arguments)"
        arg, start, end = min(self.extents, key=lambda e: (not e[1] <= lo < e[2], max(e[1] - hi, lo - e[2], 0)))
        where = f"starts {start - lo} bytes before it" if lo < start else f"ends {hi - end} bytes past its end"
        return f"{arg} [{start:#x}, {end:#x}) (the access {where})"


@contextmanager
def checked_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Checker]:
    """Check every interpreted load and store in the block (see the module docstring); yields the checker, whose
    ``accesses`` counts the accesses checked."""
    checker = _Checker()
    builder = interpreter.interpreter_builder
    load, store, call = builder.create_masked_load, builder.create_masked_store, interpreter.GridExecutor.__call__

    def checked_load(ptrs, mask, other, cache_policy, is_volatile):  # noqa: ANN001, ANN202
        checker.check("load", ptrs, mask)
        return load(ptrs, mask, other, cache_policy, is_volatile)

    def checked_store(ptrs, value, mask, cache_policy):  # noqa: ANN001, ANN202
        checker.check("store", ptrs, mask)
        return store(ptrs, value, mask, cache_policy)

    def launch(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        checker.launch(getattr(self.fn, "__name__", "kernel"), list(self.arg_names), args, kwargs)
        return call(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(builder, "create_masked_load", checked_load)
        patch.setattr(builder, "create_masked_store", checked_store)
        patch.setattr(interpreter.GridExecutor, "__call__", launch)
        try:
            yield checker
        except InterpreterError as err:  # the interpreter wraps what a kernel raises: unwrap ours
            if isinstance(err.__cause__, OutOfBounds):
                raise err.__cause__ from None
            raise
