"""The decode layout: projection weights stored the way a CPU's BLAS reads them fastest with one token.

A decode step multiplies one row of activations by every weight matrix, so its speed is how fast the weights
stream from memory. On a CPU, ``x @ W.T`` with ``W`` stored as usual ([out, in], row-major) runs a
matrix-vector product that reaches well under half of the memory's read speed; the same product over the
transposed storage ([in, out] contiguous, i.e. ``W`` column-major) streams long contiguous rows and reaches
nearly the full read speed once the output is a few thousand wide. So the decode layout

* stores q/k/v of each layer as one column-major buffer (one product of width H*D + 2*Hkv*D instead of three),
* stores gate/up of each MLP as one column-major buffer (width 2 x intermediate),
* stores ``o_proj`` and the output head (the tied embedding with it) column-major.

Parameters stay the same ``nn.Parameter`` objects with the same shapes and values: only their strides change
(``param.data`` is rebound to a view of the new buffer), so optimizers, PEFT, ``state_dict`` and weight tying
keep working and no weight is held twice. A fused product is used only while the weights still are adjacent
views of one buffer (checked by address on every call, so a parameter replaced later simply runs unfused),
and only on plain ``nn.Linear`` modules (never on a PEFT-wrapped one, whose adapter must run). Values are the
same function; float rounding may differ from the row-major product in the last bits.

A mixer may read the layer input through bias-free weights of its own (``Mixer.input_weights``: output gates,
DeltaProduct's extra keys and values, GLA's gate projection, PaTH's Householder directions); those join the q/k/v
buffer, and the layer hands their outputs to the mixer (``MixerInputs.projected``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["apply_decode_layout", "column_major", "fuse", "laid_out", "project", "restore_row_major"]


def column_major(weight: torch.Tensor) -> bool:
    """Whether a 2-D weight [out, in] is stored transposed: its own [in, out] block, or columns of a wider one."""
    return weight.dim() == 2 and weight.stride()[0] == 1 and weight.stride()[1] >= weight.shape[0]


def laid_out(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is stored in the decode layout (not its own contiguous storage)."""
    return any(not _owns_contiguous(p) for p in module.parameters())


def _rebind(param: nn.Parameter, data: torch.Tensor) -> None:
    with torch.no_grad():
        param.data = data


def _fresh(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An uninitialized buffer that is a normal tensor (usable by autograd later) even under inference_mode."""
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=like.dtype, device=like.device)


def _plain(linears: Sequence[nn.Module]) -> bool:
    return all(type(m) is nn.Linear for m in linears)


Projection = tuple[torch.Tensor, torch.Tensor | None]  # (weight [out, in], bias [out] or None)


def _pairs(linears: Sequence[nn.Module], extra: Sequence[torch.Tensor]) -> list[Projection]:
    """(weight, bias) of the linears, then the extra bias-free weights (dropped when the linears have biases)."""
    pairs: list[Projection] = [(m.weight, m.bias) for m in linears]
    if all(b is None for _, b in pairs):
        pairs += [(w, None) for w in extra]
    return pairs


def fuse(linears: Sequence[nn.Linear], extra: Sequence[torch.Tensor] = ()) -> bool:
    """Move the weights (and biases) of linears that share an input, then any ``extra`` weights [out, in] read
    from the same input, into one column-major buffer, side by side (a no-op when they already are); False when
    one of the linears is not a plain ``nn.Linear``. Extra weights join only bias-free linears."""
    if not _plain(linears):
        return False
    pairs = _pairs(linears, extra)
    if _adjacent(pairs) is not None:
        return True
    first = pairs[0][0]
    total = sum(w.shape[0] for w, _ in pairs)
    buffer = _fresh((first.shape[1], total), first)
    bias_buffer = _fresh((total,), first) if pairs[0][1] is not None else None
    start = 0
    for weight, bias in pairs:
        width = weight.shape[0]
        part = buffer[:, start : start + width]
        part.copy_(weight.detach().t())
        _rebind(weight, part.t())
        if bias_buffer is not None:
            bias_part = bias_buffer[start : start + width]
            bias_part.copy_(bias.detach())
            _rebind(bias, bias_part)
        start += width
    return True


def project(
    linears: Sequence[nn.Linear], x: torch.Tensor, memo: dict, extra: Sequence[torch.Tensor] = ()
) -> list[torch.Tensor]:
    """Each linear's output for the shared input ``x``: one product over the fused buffer while the layout
    holds and no weight is being trained, else one product each. Over the fused buffer the ``extra`` weights'
    outputs follow (``x @ w.T`` each); unfused they are left out, for their owner to compute. ``memo`` (a dict
    the caller keeps) caches the fused view between calls, keyed by the weights' addresses."""
    pairs = _pairs(linears, extra)
    training = torch.is_grad_enabled() and any(
        w.requires_grad or (b is not None and b.requires_grad) for w, b in pairs
    )
    fused = None if training or not _plain(linears) else _fused_view(pairs, memo)
    if fused is None:
        return [m(x) for m in linears]
    return list(F.linear(x, *fused).split([w.shape[0] for w, _ in pairs], dim=-1))


def _fused_view(pairs: list[Projection], memo: dict) -> Projection | None:
    key = tuple(w.data_ptr() for w, _ in pairs)
    if memo.get("key") != key:
        memo["key"], memo["view"] = key, _adjacent(pairs)
    return memo["view"]


def _adjacent(pairs: list[Projection]) -> Projection | None:
    """(weight [N, in], bias [N] or None) viewing the fused buffer, or None when the weights are not laid out
    side by side in one column-major buffer."""
    widths = [w.shape[0] for w, _ in pairs]
    weight = _side_by_side([w for w, _ in pairs], widths, column=True)
    if weight is None:
        return None
    biases = [b for _, b in pairs]
    if all(b is None for b in biases):
        return weight, None
    if any(b is None for b in biases):
        return None
    bias = _side_by_side(biases, widths, column=False)
    return None if bias is None else (weight, bias)


def _side_by_side(tensors: list[torch.Tensor], widths: list[int], column: bool) -> torch.Tensor | None:
    first = tensors[0]
    total = sum(widths)
    start = first.storage_offset()
    for t, width in zip(tensors, widths, strict=True):
        if t.dtype != first.dtype or t.device != first.device or t.storage_offset() != start:
            return None
        if t.stride() != ((1, total) if column else (1,)):
            return None
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        start += width
    if column:
        return first.detach().as_strided((total, first.shape[1]), (1, total), first.storage_offset())
    return first.detach().as_strided((total,), (1,), first.storage_offset())


def _to_column_major(linear: nn.Module) -> None:
    weight = getattr(linear, "weight", None)
    if type(linear) is not nn.Linear or weight is None or column_major(weight):
        return
    buffer = _fresh((weight.shape[1], weight.shape[0]), weight)
    buffer.copy_(weight.detach().t())
    _rebind(weight, buffer.t())


def apply_decode_layout(
    groups: Sequence[tuple[Sequence[nn.Linear], Sequence[torch.Tensor]]], singles: Sequence[nn.Module]
) -> None:
    """Fuse every group (linears sharing an input, and extra weights read from it) and store every single
    module column-major."""
    for linears, extra in groups:
        fuse(linears, extra)
    for module in singles:
        _to_column_major(module)


def restore_row_major(modules: Sequence[nn.Module]) -> None:
    """Give every parameter of the listed modules (their submodules' included) its own contiguous row-major
    storage again (a no-op for those that have it)."""
    for module in modules:
        for param in module.parameters():
            if not _owns_contiguous(param):
                with torch.inference_mode(False):
                    _rebind(param, param.detach().clone(memory_format=torch.contiguous_format))


def _owns_contiguous(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
