"""Checks shared by the mixer families' tests: random inputs, perturbed parameters and states, the forms against
each other, gradients against a reference, left padding and rejected specs.

A family's test module keeps its reference, its specs and its tolerances; these helpers only hold the steps that
every family repeats. The batch is two rows; ``mixer_steps.left_padded`` pads the second.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

import pytest
import torch
from mixer_steps import left_padded, run_chunked, run_steps
from reference import real_rows, rel_err

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.modeling.mixer_base import Mixer, MixerInputs, MixerShape, State
from hf_recattn.modeling.mixers import validate_spec

#: the families' common test shape: GQA (4 query heads on 2 key heads), two rows, the second padded by PAD
BATCH, HIDDEN, PAD = 2, 12, 3
SHAPE = MixerShape(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=8, layer_idx=5)
FORMS = ("chunked", "steps", "prefill")

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def random_inputs(shape: MixerShape, seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                  q_scale: float = 1.0) -> Inputs:
    """q [B, H, T, D], k and v [B, Hkv, T, D] and the layer input x [B, T, C], standard normal from one seeded
    generator (q times ``q_scale``), drawn in fp32 and cast to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    q = q_scale * torch.randn(BATCH, shape.num_heads, seq_len, shape.head_dim, generator=gen)
    k = torch.randn(BATCH, shape.num_kv_heads, seq_len, shape.head_dim, generator=gen)
    v = torch.randn(BATCH, shape.num_kv_heads, seq_len, shape.head_dim, generator=gen)
    x = torch.randn(BATCH, seq_len, shape.hidden_size, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), x.to(dtype)


def perturb_parameters(mixer: Mixer, scale: float = 0.3, seed: int = 3, dtype: torch.dtype | None = None) -> None:
    """Move every parameter (in name order) off its initial value by ``scale`` times seeded normal noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(mixer.named_parameters()):
            param.add_(scale * torch.randn(param.shape, generator=gen, dtype=dtype))


def init_every_module(mixer: Mixer, scramble: bool = False) -> None:
    """Run every module's ``init_parameters`` (transformers.initialization), as the model's ``_init_weights``
    does; with ``scramble`` each module's own parameters are first overwritten with standard normal noise."""
    from transformers import initialization as init

    for module in mixer.modules():
        if scramble:
            for param in module.parameters(recurse=False):
                param.data.normal_()
        if hasattr(module, "init_parameters"):
            module.init_parameters(init)


def random_state(mixer: Mixer, scale: float = 0.5, seed: int = 11) -> dict[str, torch.Tensor]:
    """A fp32 state of the mixer's shapes for a batch of two, ``scale`` times seeded normal noise."""
    gen = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s.shape, generator=gen)
            for n, s in mixer.init_state(BATCH, torch.device("cpu"), torch.float64).items()}


def outputs_of(mixer: Mixer, form: str, inputs: Inputs, mask: torch.Tensor | None) -> torch.Tensor:
    """The outputs of the ``parallel`` form, or of the ``chunked`` form from a fresh state."""
    q, k, v, x = inputs
    if form == "parallel":
        return mixer.parallel(q, k, v, MixerInputs(x, mask))
    return run_chunked(mixer, q, k, v, x, mask)[0]


def assert_forms_agree(mixer: Mixer, inputs: Inputs, mask: torch.Tensor, rel: float, prefill: int = 5,
                       whole_rows: Collection[str] = ()) -> tuple[torch.Tensor, State]:
    """The chunked form, token steps and a cached prefill of ``prefill`` tokens + steps give the parallel outputs
    (real rows; padded rows too for the forms named in ``whole_rows``), and chunks and steps end in the same state
    with the keys of ``init_state``. Returns the parallel outputs and the chunked form's final state."""
    q, k, v, x = inputs
    parallel = mixer.parallel(q, k, v, MixerInputs(x, mask))

    def check(form: str, out: torch.Tensor) -> None:
        rows = (lambda t: t) if form in whole_rows else (lambda t: real_rows(t, mask))
        assert rel_err(rows(out), rows(parallel)) <= rel, form

    chunked, chunk_state = run_chunked(mixer, q, k, v, x, mask)
    check("chunked", chunked)
    stepped, step_state = run_steps(mixer, q, k, v, x, mask)
    check("steps", stepped)
    assert set(chunk_state) == set(step_state) == set(mixer.init_state(1, q.device, q.dtype))
    for name in chunk_state:
        assert rel_err(chunk_state[name], step_state[name]) <= rel, name
    p = prefill
    head, state = mixer(q[:, :, :p], k[:, :, :p], v[:, :, :p], MixerInputs(x[:, :p], mask[:, :p]), use_cache=True)
    tail, _ = run_steps(mixer, q, k, v, x, mask, state=state, start=p)
    check("prefill", torch.cat([head, tail], dim=1))
    return parallel, chunk_state


def assert_continues_from_state(mixer: Mixer, inputs: Inputs, state: State, expected: torch.Tensor,
                                expected_state: State, rel: float, past: int = 0) -> None:
    """From ``state`` (holding ``past`` earlier tokens, all real), the chunked form and token steps give the
    reference's outputs and final state."""
    q, k, v, x = inputs
    mask = torch.ones(BATCH, past + q.shape[2], dtype=torch.bool)
    out, final = mixer.chunked(q, k, v, MixerInputs(x, mask if past else None, past), dict(state))
    assert rel_err(out, expected) <= rel
    stepped, step_final = run_steps(mixer, q, k, v, x, mask, state=dict(state), past=past)
    assert rel_err(stepped, expected) <= rel
    for name, want in expected_state.items():
        assert rel_err(final[name], want) <= rel, name
        assert rel_err(step_final[name], want) <= rel, name


def assert_gradients_match(mixer: Mixer, reference: Callable[[Inputs, torch.Tensor], torch.Tensor], seq_len: int,
                           rel: float, form: str = "parallel", unused: Collection[str] = (),
                           q_scale: float = 1.0) -> dict[str, torch.Tensor | None]:
    """float64 inputs (``random_inputs``, seed 0) with the second row padded by PAD on the left: gradients of a
    seeded random weighting of the real rows of the mixer's ``form`` and of ``reference(inputs, mask)``, with
    respect to q, k, v, x and every parameter (in name order), are finite and agree within ``rel``; the tensors
    named in ``unused`` get no gradient from either. Returns the mixer's gradients by name."""
    inputs = tuple(t.requires_grad_() for t in random_inputs(mixer.shape, seq_len, torch.float64, q_scale=q_scale))
    mask = left_padded(seq_len, PAD)
    out = outputs_of(mixer, form, inputs, mask)
    expected = reference(inputs, mask)
    names, params = zip(*sorted(mixer.named_parameters()), strict=True) if list(mixer.parameters()) else ((), ())
    names = ["q", "k", "v", "x", *names]
    tensors = [*inputs, *params]
    weights = real_rows(torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7)),
                        mask)

    def grads(o: torch.Tensor) -> Sequence[torch.Tensor | None]:
        return torch.autograd.grad((real_rows(o, mask) * weights).sum(), tensors, allow_unused=True)

    got, want = grads(out), grads(expected)
    for name, g, w in zip(names, got, want, strict=True):
        if name in unused:
            assert g is None and w is None, name
            continue
        assert g is not None and w is not None, name
        assert torch.isfinite(g).all(), name
        assert rel_err(g, w) <= rel, name
    return dict(zip(names, got, strict=True))


def assert_left_padding_changes_nothing(mixer: Mixer, inputs: Inputs, pad: int, rel: float,
                                        cache_axis: int | None = None) -> None:
    """Row 1 padded by ``pad`` tokens on the left gives, in the chunked form, the outputs and final state of its
    real tokens alone; with ``cache_axis`` the state holds one entry a token on that axis (its real tokens
    compared)."""
    q, k, v, x = inputs
    mask = left_padded(q.shape[2], pad)
    out, state = run_chunked(mixer, q, k, v, x, mask)
    tail = slice(pad, None)
    alone, alone_state = mixer.chunked(q[1:, :, tail], k[1:, :, tail], v[1:, :, tail], MixerInputs(x[1:, tail]),
                                       mixer.init_state(1, q.device, q.dtype))
    assert rel_err(out[1:, tail], alone) <= rel
    for name in state:
        row = state[name][1:]
        if cache_axis is not None:
            row = row.narrow(cache_axis, pad, row.shape[cache_axis] - pad)
        assert rel_err(row, alone_state[name]) <= rel, name


def assert_padded_step_keeps_state(mixer: Mixer, inputs: Inputs, state: State) -> None:
    """One step in which row 1 is padding leaves row 1's state as it was and changes row 0's."""
    q, k, v, x = inputs
    _, new = mixer.step(q, k, v, MixerInputs(x, torch.tensor([[True], [False]]), past_length=4), dict(state))
    for name in state:
        assert torch.equal(new[name][1], state[name][1]), name
        assert not torch.equal(new[name][0], state[name][0]), name


def assert_specs_rejected(cases: Iterable[tuple[dict | str, str, str]]) -> None:
    """Each (spec, where, pattern): ``validate_spec(spec, where)`` raises a ValueError matching the pattern."""
    for spec, where, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            validate_spec(spec, where)


def tiny_perturbed_model(attention: dict, overrides: dict | None = None) -> RecAttnForCausalLM:
    """A seeded 2-layer model of ``attention`` (and per-layer ``overrides``) in eval mode whose mixer parameters are
    moved off their initial values, so that a test can tell its parts apart."""
    torch.manual_seed(0)
    config = RecAttnConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           attention=attention, attention_overrides=overrides)
    model = RecAttnForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mixer." in name:
                p.add_(0.3 * torch.randn_like(p))
    return model
