"""The far-part protocol (modeling/far_part.py): families registered here, with ``register_mixer``, serve as a
hybrid's far part by declaring only the protocol, so the hybrid names no family.

* ``toy_leaving`` reads the keys leaving the window and shares its sums (combine='shared'): elu + 1 features written
  out here in plain torch, so the hybrid must equal the hybrid with ``{"mixer": "linear", "feature_map": "elu"}``
  (fp32, < 1e-5 relative) in every form.
* ``toy_arriving`` reads every token as it arrives and keeps FarPart's defaults (its own forms, combine='sum'): the
  hybrid must be g * (the window part alone) + (1 - g) * the toy's own output, the toy run on all tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from mixer_steps import left_padded, run_chunked, run_steps
from reference_recurrent_softmax import real_rows, rel_err

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.modeling.far_part import ARRIVING, LEAVING, FarPart, FarTerms
from hf_recattn.modeling.mixer_base import Mixer, MixerInputs, MixerShape, State, group_queries, ungroup_output
from hf_recattn.modeling.mixers import MIXERS, build_mixer, register_mixer, validate_spec
from hf_recattn.modeling.options import Option
from hf_recattn.modeling.variants import variant_models

H, HKV, D, C = 4, 2, 8, 16
SHAPE = MixerShape(C, H, HKV, D, 2)
EPS = 1e-6


class ToyLeaving(Mixer, FarPart):
    """Causal linear attention with elu + 1 features, as the far-part protocol alone."""

    name = "toy_leaving"
    options = {"causal": Option((bool,), True, "causal")}
    far_reads = LEAVING
    far_shared = True

    @classmethod
    def far_part_problem(cls, spec: dict[str, Any], combine: str) -> str | None:
        return None if spec["rope"] else "a toy far part wants rope"

    def _features(self, q: torch.Tensor, k: torch.Tensor, inputs: MixerInputs) -> tuple[torch.Tensor, torch.Tensor]:
        kf = F.elu(k) + 1.0
        if inputs.token_mask is not None:
            kf = kf * inputs.token_mask[:, None, :, None].to(kf.dtype)
        return F.elu(group_queries(q, HKV)) + 1.0, kf

    def far_parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs) -> FarTerms:
        qf, kf = self._features(q, k, inputs)
        t = q.shape[2]
        scores = torch.einsum("bhgtf,bhsf->bhgts", qf, kf) * torch.ones(t, t).tril()
        return FarTerms(torch.einsum("bhgts,bhse->bhgte", scores, v), scores.sum(-1))

    def far_chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[FarTerms, State]:
        qf, kf = self._features(q, k, inputs)
        S, z, nums, dens = state["S"], state["z"], [], []
        for t in range(q.shape[2]):
            S = S + kf[:, :, t, :, None] * v[:, :, t, None, :]
            z = z + kf[:, :, t]
            nums.append(torch.einsum("bhgf,bhfe->bhge", qf[:, :, :, t], S))
            dens.append(torch.einsum("bhgf,bhf->bhg", qf[:, :, :, t], z))
        return FarTerms(torch.stack(nums, 3), torch.stack(dens, 3)), {"S": S, "z": z}

    far_step = far_chunked

    def far_output(self, terms: FarTerms, inputs: MixerInputs) -> torch.Tensor:
        return ungroup_output(terms.num / (terms.den[..., None] + EPS))

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        return {"S": torch.zeros(batch_size, HKV, D, D, dtype=dtype), "z": torch.zeros(batch_size, HKV, D, dtype=dtype)}

    def state_size(self, context_length: int) -> int:
        return HKV * D * (D + 1)


class ToyArriving(Mixer, FarPart):
    """o_t = the mean of the real values so far, per key head: its own forms, FarPart's defaults."""

    name = "toy_arriving"
    options = {"causal": Option((bool,), True, "causal")}
    far_reads = ARRIVING

    def _run(self, v: torch.Tensor, inputs: MixerInputs, state: State) -> tuple[torch.Tensor, State]:
        real = torch.ones(v.shape[0], v.shape[2]) if inputs.token_mask is None else inputs.token_mask.to(v.dtype)
        total = state["sum"][:, :, None] + (v * real[:, None, :, None]).cumsum(2)
        count = state["count"][:, None] + real.cumsum(1)
        out = total / count.clamp_min(1.0)[:, None, :, None]  # [B, Hkv, T, E]
        out = out[:, :, None].expand(-1, -1, H // HKV, -1, -1)
        return ungroup_output(out), {"sum": total[:, :, -1], "count": count[:, -1]}

    def parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs) -> torch.Tensor:
        return self._run(v, inputs, self.init_state(v.shape[0], v.device, v.dtype))[0]

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        return self._run(v, inputs, state)

    step = chunked

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        return {"sum": torch.zeros(batch_size, HKV, D, dtype=dtype), "count": torch.zeros(batch_size, dtype=dtype)}

    def state_size(self, context_length: int) -> int:
        return HKV * D + 1


@pytest.fixture(autouse=True, scope="module")
def toys() -> Iterator[None]:
    for cls in (ToyLeaving, ToyArriving):
        register_mixer(cls)
    yield
    for cls in (ToyLeaving, ToyArriving):
        MIXERS.pop(cls.name)


def hybrid(far: Any, combine: str, sinks: int = 0) -> Mixer:
    spec = validate_spec({"mixer": "hybrid", "window": 3, "sink_tokens": sinks, "far": far, "combine": combine,
                          "chunk_size": 4}, "layer 2")
    torch.manual_seed(0)
    mixer = build_mixer(spec, SHAPE)
    with torch.no_grad():
        mixer.mix_logit.copy_(torch.tensor([-1.0, 0.0, 0.7, 2.0]))
    return mixer


def data(seq_len: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(2, H, seq_len, D, generator=gen), torch.randn(2, HKV, seq_len, D, generator=gen),
            torch.randn(2, HKV, seq_len, D, generator=gen), torch.randn(2, seq_len, C, generator=gen))


def forms(mixer: Mixer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
          mask: torch.Tensor) -> list[torch.Tensor]:
    """The parallel, chunked and token-by-token outputs on the real rows."""
    outs = [mixer.parallel(q, k, v, MixerInputs(x, mask)), run_chunked(mixer, q, k, v, x, mask)[0],
            run_steps(mixer, q, k, v, x, mask)[0]]
    return [real_rows(out, mask) for out in outs]


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("combine", ["shared", "sum"])
def test_a_family_that_reads_leaving_keys_serves_by_the_protocol_alone(combine: str, sinks: int) -> None:
    q, k, v, x = data(11)
    mask = left_padded(11, 3)
    with torch.no_grad():
        got = forms(hybrid("toy_leaving", combine, sinks), q, k, v, x, mask)
        want = forms(hybrid({"mixer": "linear", "feature_map": "elu"}, combine, sinks), q, k, v, x, mask)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < 1e-5
    assert rel_err(got[0], real_rows(hybrid("none", combine, sinks).parallel(q, k, v, MixerInputs(x, mask)),
                                     mask)) > 1e-3  # the far part matters


@pytest.mark.parametrize("sinks", [0, 2])
def test_a_family_that_reads_every_token_serves_with_the_defaults(sinks: int) -> None:
    q, k, v, x = data(11)
    mask = left_padded(11, 3)
    mixer = hybrid("toy_arriving", "sum", sinks)
    with torch.no_grad():
        near = hybrid("none", "sum", sinks).parallel(q, k, v, MixerInputs(x, mask))
        far = mixer.far.parallel(q, k, v, MixerInputs(x, mask))
        share = torch.sigmoid(mixer.mix_logit)[:, None]
        want = real_rows(share * near + (1 - share) * far, mask)
        got = forms(mixer, q, k, v, x, mask)
    for g in got:
        assert rel_err(g, want) < 1e-5
    assert set(mixer.init_state(2, q.device, q.dtype)) >= {"far.sum", "far.count"}


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ({"far": "toy_arriving"}, r"layer 2: option 'far' a toy_arriving far mixer needs combine='sum'"),
        ({"far": {"mixer": "toy_leaving", "rope": False}}, r"layer 2: option 'far' a toy far part wants rope"),
        ({"far": {"mixer": "toy_leaving", "causal": False}}, r"layer 2: option 'far' the far mixer must be causal"),
        ({"far": "softmax"}, r"layer 2: option 'far' must be a linear or taylor or delta or (\w+ or )*toy_leaving "
                             r"or toy_arriving spec, got mixer 'softmax'"),
    ],
)
def test_the_protocol_decides_what_serves(spec: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        validate_spec({"mixer": "hybrid", **spec}, "layer 2")


def test_variants_of_a_hybrid_with_a_new_far_part() -> None:
    """Conversion's variant models follow the hybrid's declared variants, whatever its far family."""
    config = RecAttnConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           attention={"mixer": "hybrid", "window": 3, "far": "toy_arriving", "combine": "sum"})
    torch.manual_seed(0)
    model = RecAttnForCausalLM(config).eval()
    variants = variant_models(model)
    assert variants["far-only"].config.layer_spec(0)["mixer"] == "toy_arriving"
    assert variants["window-only"].config.layer_spec(1)["mixer"] == "sliding_window"
    ids = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        far_only = variants["far-only"](input_ids=ids).logits
        hybrid_logits = model(input_ids=ids).logits
    assert torch.isfinite(far_only).all() and (far_only - hybrid_logits).abs().max() > 1e-4
