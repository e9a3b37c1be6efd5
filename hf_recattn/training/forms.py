"""The decoder layers of a model and the faster training form of each mixer (parallel or chunked)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import torch
from torch import nn

from ..modeling.mixer_base import MixerInputs


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers at ``.model.layers`` (through a PEFT wrapper)."""
    get_base = getattr(model, "get_base_model", None)  # a PEFT wrapper
    if callable(get_base):
        model = get_base()
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers")
    return layers


def _synchronize(device: torch.device) -> None:
    """Wait for a GPU's queued work, so that a clock around it times the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_form(mixer: nn.Module, form: str, seq_len: int, hidden_size: int, repeats: int = 2) -> float:
    shape = mixer.shape
    first = next(mixer.parameters(), None)  # a bf16 mixer is timed on bf16 inputs, on its own device
    device, dtype = (torch.device("cpu"), torch.float32) if first is None else (first.device, first.dtype)
    gen = torch.Generator().manual_seed(0)
    best = float("inf")
    for _ in range(repeats):
        q = (
            torch.randn(1, shape.num_heads, seq_len, shape.head_dim, generator=gen)
            .to(device, dtype)
            .requires_grad_()
        )
        k = (
            torch.randn(1, shape.num_kv_heads, seq_len, shape.head_dim, generator=gen)
            .to(device, dtype)
            .requires_grad_()
        )
        v = (
            torch.randn(1, shape.num_kv_heads, seq_len, shape.head_dim, generator=gen)
            .to(device, dtype)
            .requires_grad_()
        )
        inputs = MixerInputs(hidden_states=torch.randn(1, seq_len, hidden_size, generator=gen).to(device, dtype))
        _synchronize(device)
        start = time.perf_counter()
        if form == "parallel":
            out = mixer.parallel(q, k, v, inputs)
        else:
            out, _ = mixer.chunked(q, k, v, inputs, mixer.init_state(1, device, q.dtype))
        out.float().square().mean().backward()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


@contextlib.contextmanager
def fastest_forms(model: nn.Module, seq_len: int, enabled: bool = True) -> Iterator[dict[str, str]]:
    """Without a cache at ``seq_len`` (training, perplexity), run each mixer in its faster form.

    Both forms compute the same function (the mixer contract, tested per family); which one is faster
    depends on the family and the length (a quadratic parallel form wins at short lengths for Taylor
    mixers, the chunked one for Heinsen's). Each distinct spec is timed once (forward + backward on random
    inputs); a mixer whose parallel form wins has ``has_chunked`` switched off on the instance until exit.
    Yields ``{spec as JSON: chosen form}``.
    """
    chosen: dict[str, str] = {}
    switched: list[nn.Module] = []
    if enabled:
        layers = decoder_layers(model)
        hidden_size = getattr(model.config, "hidden_size", None)
        for layer in layers:
            mixer = layer.self_attn.mixer
            if "has_chunked" in vars(mixer):  # an enclosing fastest_forms already chose for this mixer
                continue
            key = json.dumps(mixer.spec, sort_keys=True, default=str)
            if key not in chosen:
                chunk = mixer.spec.get("chunk_size")
                if not mixer.has_chunked or chunk is None or seq_len <= chunk or hidden_size is None:
                    chosen[key] = "default"
                else:
                    with torch.enable_grad():
                        par = _time_form(mixer, "parallel", seq_len, hidden_size)
                        chk = _time_form(mixer, "chunked", seq_len, hidden_size)
                    mixer.zero_grad(set_to_none=True)
                    chosen[key] = "parallel" if par < chk else "chunked"
            if chosen[key] == "parallel":
                mixer.has_chunked = False  # instance attribute: Mixer.forward then takes the parallel form
                switched.append(mixer)
    try:
        yield chosen
    finally:
        for mixer in switched:
            del mixer.has_chunked  # back to the class attribute
