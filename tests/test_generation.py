"""generate() with the recurrent cache, for every mixer and for models mixing mixers.

The reference everywhere is the model without a cache (``use_cache=False``: the full parallel forward over
the whole sequence at every step), which no cache code touches. Tolerances: fp32 logits of cached decoding
within 1e-4 of the full forward; tokens equal exactly (the tiny models are initialized with std 0.1 so that
their logits are far apart compared with fp32 rounding); states after different prefill splits within
rtol = atol = 1e-5 (log-space states compared as the sums they stand for).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from generation_cases import PAD, Case, case_params, left_padded_batch, one_thread, tiny_model
from isolated import HIDE_HF_RECATTN
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from hf_recattn import MIXERS, Mixer, MixerInputs, RecAttnCache, RecAttnForCausalLM

CASES = case_params()
NEW = 6
#: states kept as logarithms of sums (ops_heinsen): equal as sums, i.e. relative to each head's largest entry
LOG_SPACE_STATES = {"heinsen": ("hz",)}


def _generate(model, ids, mask, **kwargs):  # noqa: ANN001, ANN003, ANN202
    return model.generate(ids, attention_mask=mask, pad_token_id=PAD, **kwargs)


def _extend(mask: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([mask, torch.ones(mask.shape[0], n, dtype=mask.dtype)], dim=1)


@dataclass
class Reference:
    """One case's model, left-padded prompts, greedy decoding without and with the cache, and forms used."""

    model: RecAttnForCausalLM
    ids: torch.Tensor
    mask: torch.Tensor
    plain: torch.Tensor  # greedy tokens, use_cache=False
    cached: Any  # greedy generate() output with the cache: sequences, logits, past_key_values
    forms_cached: dict[str, int]
    forms_plain: dict[str, int]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


@pytest.fixture(scope="module", params=CASES)
def ref(request: pytest.FixtureRequest) -> Reference:
    one_thread()  # module fixtures are set up before the function-scoped ones
    model = tiny_model(request.param)
    ids, mask = left_padded_batch()
    with count_forms(model) as forms_plain:
        plain = _generate(model, ids, mask, max_new_tokens=NEW, do_sample=False, use_cache=False)
    with count_forms(model) as forms_cached:
        cached = _generate(model, ids, mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
    return Reference(model, ids, mask, plain, cached, forms_cached, forms_plain)


@contextmanager
def count_forms(model: RecAttnForCausalLM) -> Iterator[dict[str, int]]:
    """Count the calls of each mixer form (parallel / chunked / step) over all layers."""
    counts = {"parallel": 0, "chunked": 0, "step": 0}
    mixers = [layer.self_attn.mixer for layer in model.model.layers]
    for mixer in mixers:
        for form in counts:
            original = getattr(mixer, form)

            def counted(*args: Any, _form: str = form, _original: Any = original, **kwargs: Any) -> Any:
                counts[_form] += 1
                return _original(*args, **kwargs)

            setattr(mixer, form, counted)
    try:
        yield counts
    finally:
        for mixer in mixers:
            for form in counts:
                delattr(mixer, form)


# ----- tokens: cache vs no cache ---------------------------------------------------------------------------
def test_greedy_with_cache_equals_without(ref: Reference) -> None:
    assert ref.cached.sequences.shape == (3, ref.ids.shape[1] + NEW)
    assert torch.equal(ref.cached.sequences, ref.plain)


def test_prefill_runs_chunked_and_decode_runs_step(ref: Reference) -> None:
    layers = len(ref.model.model.layers)
    assert ref.forms_cached == {"parallel": 0, "chunked": layers, "step": layers * (NEW - 1)}
    plain = ref.forms_plain
    assert plain["step"] == 0 and plain["parallel"] + plain["chunked"] == NEW * layers


def test_beam_search_with_cache_equals_without(ref: Reference) -> None:
    kwargs = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False)
    cached = _generate(ref.model, ref.ids, ref.mask, **kwargs)
    plain = _generate(ref.model, ref.ids, ref.mask, use_cache=False, **kwargs)
    assert cached.shape[0] == 6
    assert torch.equal(cached, plain)


def test_sampling_num_return_sequences(ref: Reference) -> None:
    kwargs = dict(max_new_tokens=NEW, do_sample=True, num_return_sequences=3, top_k=0)
    torch.manual_seed(5)
    out = _generate(ref.model, ref.ids, ref.mask, return_dict_in_generate=True, **kwargs)
    torch.manual_seed(5)
    plain = _generate(ref.model, ref.ids, ref.mask, use_cache=False, **kwargs)
    assert torch.equal(out.sequences, plain)
    assert out.past_key_values.batch_size == 9  # the cache was expanded with the prompts
    assert out.sequences.shape == (9, ref.ids.shape[1] + NEW)
    assert len({tuple(row) for row in out.sequences[:3, -NEW:].tolist()}) > 1  # the samples differ


# ----- logits: cached decoding vs the full forward ---------------------------------------------------------
def test_cached_logits_equal_full_forward(ref: Reference) -> None:
    model, ids, mask = ref.model, ref.ids, ref.mask
    steps = torch.stack(ref.cached.logits, dim=1)  # [B, NEW, V]: prefill's last position, then each step
    width = ids.shape[1]
    with torch.no_grad():
        full = model(ref.cached.sequences, attention_mask=_extend(mask, NEW), use_cache=False).logits
        prefill = model(ids, attention_mask=mask, past_key_values=model.new_cache(), use_cache=True).logits
    torch.testing.assert_close(steps, full[:, width - 1 : -1], rtol=0, atol=1e-4)
    real = mask.bool()
    torch.testing.assert_close(prefill[real], full[:, :width][real], rtol=0, atol=1e-4)


def test_left_padding_does_not_change_a_row(ref: Reference) -> None:
    """A left-padded row decodes as the same tokens alone without padding (positions come from the mask)."""
    real = ref.ids[0][ref.mask[0].bool()][None]
    alone = _generate(ref.model, real, torch.ones_like(real), max_new_tokens=NEW, do_sample=False,
                      output_logits=True, return_dict_in_generate=True)
    assert torch.equal(ref.cached.sequences[0, -NEW:], alone.sequences[0, -NEW:])
    torch.testing.assert_close(torch.stack(ref.cached.logits)[:, 0], torch.stack(alone.logits)[:, 0],
                               rtol=0, atol=1e-4)


# ----- prefill: one call, chunks, token by token -----------------------------------------------------------
def _prefill(model, ids, mask, splits):  # noqa: ANN001, ANN202
    cache = model.new_cache()
    logits, start = [], 0
    with torch.no_grad():
        for n in splits:
            stop = start + n
            logits.append(model(ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache,
                                use_cache=True).logits)
            start = stop
    return cache, torch.cat(logits, dim=1)


def test_prefill_in_one_call_chunks_or_tokens_gives_the_same_state(ref: Reference) -> None:
    model = ref.model
    ids, mask = left_padded_batch((7, 11, 10))
    t = ids.shape[1]
    one, logits_one = _prefill(model, ids, mask, [t])
    for splits in ([4, 5, 2], [1] * t):
        other, logits_other = _prefill(model, ids, mask, splits)
        assert other.get_seq_length() == one.get_seq_length() == t
        for block, a, b in zip(model.model.layers, one.layers, other.layers, strict=True):
            assert a.state.keys() == b.state.keys()
            log_space = LOG_SPACE_STATES.get(block.self_attn.mixer.name, ())
            for name in a.state:
                x, y = b.state[name], a.state[name]
                if name in log_space:  # compare the sums themselves, relative to the largest of each head
                    top = y.flatten(2).amax(-1).view(*y.shape[:2], *[1] * (y.dim() - 2))
                    x, y = (x - top).exp(), (y - top).exp()
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5,
                                           msg=f"layer {a.layer_idx} state {name!r}, splits {splits}")
        real = mask.bool()
        torch.testing.assert_close(logits_other[real], logits_one[real], rtol=0, atol=1e-4)


# ----- stopping, continuing --------------------------------------------------------------------------------
class StopAtLength(StoppingCriteria):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: object) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_stopping_criteria_and_eos(ref: Reference) -> None:
    model, ids, mask = ref.model, ref.ids, ref.mask
    width = ids.shape[1]
    stop = StoppingCriteriaList([StopAtLength(width + 3)])
    out = _generate(model, ids, mask, max_new_tokens=NEW, do_sample=False, stopping_criteria=stop)
    assert torch.equal(out, ref.plain[:, : width + 3])
    eos = int(ref.plain[0, width + 1])  # row 0 ends at its 2nd new token (or its 1st, if that is the same)
    ends = width + int((ref.plain[0, width:] == eos).nonzero()[0])
    cached = _generate(model, ids, mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    plain = _generate(model, ids, mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                      use_cache=False)
    assert torch.equal(cached, plain)
    assert cached[0, ends] == eos and bool((cached[0, ends + 1 :] == PAD).all())


def test_continue_from_returned_cache(ref: Reference) -> None:
    model, ids, mask = ref.model, ref.ids, ref.mask
    first = _generate(model, ids, mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert isinstance(first.past_key_values, RecAttnCache)
    assert first.past_key_values.get_seq_length() == ids.shape[1] + 2  # the last token is not fed yet
    second = _generate(model, first.sequences, _extend(mask, 3), past_key_values=first.past_key_values,
                       max_new_tokens=NEW - 3, do_sample=False)
    assert torch.equal(second, ref.plain)


def test_continue_from_returned_cache_with_beams() -> None:
    """The cache passed in is repeated for the beams like the prompts (it holds one row per prompt)."""
    model = tiny_model(Case("linear", {"mixer": "linear", "feature_map": "taylor2"}))
    ids, mask = left_padded_batch()
    first = _generate(model, ids, mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    beams = dict(max_new_tokens=4, num_beams=2, do_sample=False)
    second = _generate(model, first.sequences, _extend(mask, 3), past_key_values=first.past_key_values,
                       **beams)
    plain = _generate(model, first.sequences, _extend(mask, 3), use_cache=False, **beams)
    assert torch.equal(second, plain)


def test_generate_prefill_chunk_size(ref: Reference) -> None:
    """transformers' own chunked prefill (prefill_chunk_size) feeds the cache in pieces: same tokens."""
    out = _generate(ref.model, ref.ids, ref.mask, max_new_tokens=NEW, do_sample=False, prefill_chunk_size=4)
    assert torch.equal(out, ref.plain)


def test_generate_from_inputs_embeds(ref: Reference) -> None:
    embeds = ref.model.get_input_embeddings()(ref.ids)
    out = ref.model.generate(inputs_embeds=embeds, attention_mask=ref.mask, max_new_tokens=NEW,
                             do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, ref.plain[:, ref.ids.shape[1] :])


class StepOnlyMixer(Mixer):
    """A running mean of the values of real tokens: parallel and step forms, no chunked one."""

    name = "test_step_only"
    state_kind = "recurrent"

    def _expand(self, o: torch.Tensor) -> torch.Tensor:  # [B, Hkv, T, E] -> [B, T, H, E]
        return o.repeat_interleave(self.shape.groups, dim=1).transpose(1, 2)

    def _real(self, v: torch.Tensor, inputs: MixerInputs) -> torch.Tensor:
        mask = inputs.token_mask
        return torch.ones_like(v[..., :1]) if mask is None else mask[:, None, :, None].to(v.dtype)

    def parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs
                 ) -> torch.Tensor:
        real = self._real(v, inputs)
        return self._expand((v * real).cumsum(2) / real.cumsum(2).clamp(min=1))

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs,
             state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        real = self._real(v, inputs)
        s, n = state["s"] + v * real, state["n"] + real
        return self._expand(s / n.clamp(min=1)), {"s": s, "n": n}

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype
                   ) -> dict[str, torch.Tensor]:
        hk, e = self.shape.num_kv_heads, self.shape.head_dim
        return {"s": torch.zeros(batch_size, hk, 1, e, device=device, dtype=dtype),
                "n": torch.zeros(batch_size, hk, 1, 1, device=device, dtype=dtype)}

    def state_size(self, context_length: int) -> int:
        return self.shape.num_kv_heads * (self.shape.head_dim + 1)


def test_a_family_without_chunked_form_generates() -> None:
    """Prefill with a cache falls back to the step form token by token (Mixer.chunked's default)."""
    MIXERS[StepOnlyMixer.name] = StepOnlyMixer
    try:
        model = tiny_model(Case("step_only", {"mixer": StepOnlyMixer.name},
                                {"0": {"mixer": "linear", "feature_map": "elu"}}))
        ids, mask = left_padded_batch()
        with count_forms(model) as forms:
            out = _generate(model, ids, mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
        assert forms == {"parallel": 0, "chunked": 2, "step": ids.shape[1] + 2 * (NEW - 1)}
        assert torch.equal(out.sequences, _generate(model, ids, mask, max_new_tokens=NEW, do_sample=False,
                                                    use_cache=False))
        with torch.no_grad():
            full = model(out.sequences, attention_mask=_extend(mask, NEW)).logits
        steps = torch.stack(out.logits, 1)
        torch.testing.assert_close(steps, full[:, ids.shape[1] - 1 : -1], rtol=0, atol=1e-4)
    finally:
        MIXERS.pop(StepOnlyMixer.name)


# ----- refused input ---------------------------------------------------------------------------------------
def _case(spec: dict) -> Case:
    return Case(spec["mixer"], spec)


def test_assisted_decoding_is_refused() -> None:
    model = tiny_model(_case({"mixer": "linear"}))
    ids, mask = left_padded_batch()
    refusal = r"assisted / speculative generation needs a cache that can roll back: layer 0 \(linear\)"
    with pytest.raises(ValueError, match=refusal):
        _generate(model, ids[:1], mask[:1], max_new_tokens=3,
                  assistant_model=tiny_model(_case({"mixer": "linear"})))
    with pytest.raises(ValueError, match=refusal):
        _generate(model, ids[:1], mask[:1], max_new_tokens=3, prompt_lookup_num_tokens=2)


def test_cache_with_another_batch_size_is_refused() -> None:
    model = tiny_model(_case({"mixer": "linear"}))
    ids, mask = left_padded_batch()
    cache = model.new_cache()
    model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="holds 3 sequences but the input has 2"):
        model(ids[:2, :1], attention_mask=_extend(mask[:2], 1), past_key_values=cache, use_cache=True)


def test_cache_of_another_model_is_refused() -> None:
    model = tiny_model(_case({"mixer": "linear"}))
    other = tiny_model(_case({"mixer": "linear"}))
    ids, mask = left_padded_batch()
    cache = other.new_cache()
    with pytest.raises(ValueError, match="another model"):
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    foreign = RecAttnCache(["kv", "kv"])  # built by hand: no owner, but the wrong layer kinds
    with pytest.raises(ValueError, match="layer 0: past_key_values holds a 'kv' state"):
        model(ids, attention_mask=mask, past_key_values=foreign, use_cache=True)
    filled = DynamicCache()
    filled.update(torch.zeros(3, 2, 4, 8), torch.zeros(3, 2, 4, 8), 0)
    with pytest.raises(TypeError, match="need a RecAttnCache"):
        model(ids, attention_mask=mask, past_key_values=filled, use_cache=True)


def test_empty_transformers_cache_is_replaced() -> None:
    model = tiny_model(_case({"mixer": "linear"}))
    ids, mask = left_padded_batch()
    out = _generate(model, ids, mask, max_new_tokens=3, do_sample=False, past_key_values=DynamicCache(),
                    return_dict_in_generate=True)
    assert isinstance(out.past_key_values, RecAttnCache)
    assert torch.equal(out.sequences, _generate(model, ids, mask, max_new_tokens=3, do_sample=False))


def test_length_limit() -> None:
    """Beyond max_position_embeddings, for a model that needs positions (softmax): a clear error before any token;
    up to it: generation works. Students that need none run past it: tests/test_length_limit.py."""
    model = tiny_model(_case({"mixer": "softmax"}), max_positions=16)
    ids, mask = left_padded_batch((10, 12))
    out = _generate(model, ids, mask, max_new_tokens=4, do_sample=False)  # exactly 16 tokens
    assert out.shape[1] == 16
    with pytest.raises(ValueError, match="max_position_embeddings=16; lower max_new_tokens to at most 4"):
        _generate(model, ids, mask, max_new_tokens=5, do_sample=False)
    long_ids = torch.randint(1, 64, (1, 17))
    with pytest.raises(ValueError, match="prompt has 17 tokens"):
        model.generate(long_ids, max_new_tokens=1)
    cache = model.new_cache()
    model(long_ids[:, :16], past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="16 cached \\+ 1 new tokens exceed max_position_embeddings=16"):
        model(long_ids[:, 16:], past_key_values=cache, use_cache=True)


def test_cache_implementation_is_refused() -> None:
    model = tiny_model(_case({"mixer": "linear"}))
    ids, mask = left_padded_batch()
    with pytest.raises(ValueError, match="cache_implementation='static' is not supported"):
        _generate(model, ids, mask, max_new_tokens=2, cache_implementation="static")


# ----- trust_remote_code without the package ---------------------------------------------------------------
#: run in the child (started with ``python -I``) after tests/isolated.py's HIDE_HF_RECATTN hides hf_recattn
REMOTE_GENERATE = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    try:
        import hf_recattn  # noqa: F401
        sys.exit("hf_recattn is importable: the test would prove nothing")
    except ModuleNotFoundError:
        pass
    path = sys.argv[1]
    ids, mask = torch.tensor(json.loads(sys.argv[2])), torch.tensor(json.loads(sys.argv[3]))
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2, do_sample=False,
                           pad_token_id=0)
    print(json.dumps({"greedy": greedy.tolist(), "beams": beams.tolist()}))
    """
)


def test_remote_code_model_generates_identically(tmp_path: Path) -> None:
    case = Case("mixed", {"mixer": "linear", "feature_map": "taylor2"},
                {"0": {"mixer": "sliding_window", "window": 3}, "-1": {"mixer": "softmax"}}, 3)
    model = tiny_model(case)
    model.save_pretrained(tmp_path / "ckpt")
    ids, mask = left_padded_batch()
    greedy = _generate(model, ids, mask, max_new_tokens=6, do_sample=False)
    beams = _generate(model, ids, mask, max_new_tokens=4, num_beams=2, do_sample=False)
    script = tmp_path / "remote_generate.py"
    script.write_text(HIDE_HF_RECATTN + REMOTE_GENERATE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run(
        [sys.executable, "-I", str(script), str(tmp_path / "ckpt"), json.dumps(ids.tolist()),
         json.dumps(mask.tolist())],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    assert remote["greedy"] == greedy.tolist()
    assert remote["beams"] == beams.tolist()
