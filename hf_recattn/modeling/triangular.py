"""The unit lower-triangular solve of the delta rules' UT transform (ops_delta.py, ops_generalized_delta.py) and of
the softmax families fed back through their keys (ops_softmax_delta.py, ops_softmax_householder.py)."""

from __future__ import annotations

import torch


def unit_lower_solve(lower: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """X with (I + strictly_lower(lower)) X = rhs. LAPACK / cuBLAS have no half-precision triangular solve: bf16 /
    fp16 inputs are solved in float32 and come back in ``rhs``'s dtype.

    Args:
        lower: ``[..., C, C]``; only its strictly lower triangle is read (the diagonal counts as ones).
        rhs: ``[..., C, E]`` right-hand sides.

    Returns:
        ``[..., C, E]`` the solution, in ``rhs``'s dtype.

    Example:
        >>> unit_lower_solve(torch.tensor([[9.0, 9.0], [2.0, 9.0]]), torch.tensor([[1.0], [4.0]]))
        tensor([[1.],
                [2.]])
    """
    if lower.dtype in (torch.float16, torch.bfloat16):
        return unit_lower_solve(lower.float(), rhs.float()).to(rhs.dtype)
    return torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
