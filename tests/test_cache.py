"""RecAttnCache: layer kinds, batch manipulation, crop, transformers' Cache API, and constant-size states."""

from __future__ import annotations

import pytest
import torch
from generation_cases import Case, all_cases, case_params, kinds, left_padded_batch, one_thread, tiny_model

from hf_recattn import RecAttnCache, cache_of
from hf_recattn.modeling.cache import CACHE_NAME, MixerStateLayer

CASES = case_params()


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


def _states(batch: int = 3, tokens: int = 5) -> dict[str, dict[str, torch.Tensor]]:
    """Hand-made states of each kind; every row is distinct so that row moves are visible."""
    rows = torch.arange(batch, dtype=torch.float32).view(batch, 1, 1, 1)
    return {
        "kv": {"k": rows + torch.rand(batch, 2, tokens, 4), "v": rows + torch.rand(batch, 2, tokens, 4)},
        "window": {"k": rows + torch.rand(batch, 2, 3, 4), "v": rows + torch.rand(batch, 2, 3, 4)},
        "recurrent": {"S": rows + torch.rand(batch, 2, 6, 4), "z": rows[..., 0] + torch.rand(batch, 2, 6),
                      "n": rows[:, :, 0, 0] + torch.rand(batch, 2)},
    }


def _filled_cache(tokens: int = 5) -> RecAttnCache:
    cache = RecAttnCache(["kv", "window", "recurrent"])
    for layer, state in zip(cache.layers, _states(tokens=tokens).values(), strict=True):
        layer.update(state, tokens)
    return cache


# ----- layer kinds and the Cache API -----------------------------------------------------------------------
def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="layer 2: unknown cache kind 'ssm'"):
        RecAttnCache(["kv", "recurrent", "ssm"])


def test_a_cache_is_built_for_a_model_not_from_its_config() -> None:
    """RecAttnCache(config) names the ways to build one; for_model takes the model with or without its head and
    gives the cache new_cache() gives (the one the model accepts)."""
    model = tiny_model(next(case for case in all_cases() if case.id == "linear(feature_map=elu)"))
    with pytest.raises(TypeError, match=r"not RecAttnConfig; for a model, use model.new_cache\(\)"):
        RecAttnCache(model.config)
    for owner in (model, model.model):
        cache = RecAttnCache.for_model(owner)
        assert cache.kinds == model.new_cache().kinds and cache.model_id == model.new_cache().model_id
    model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=RecAttnCache.for_model(model), use_cache=True)


def test_transformers_cache_api_on_any_mix_of_kinds() -> None:
    empty = RecAttnCache(["recurrent", "recurrent"])
    assert empty.get_seq_length() == 0 and empty.batch_size == -1 and empty.max_batch_size is None
    assert not empty.is_initialized and empty.nbytes() == 0
    cache = _filled_cache()
    assert [cache.get_seq_length(i) for i in range(3)] == [5, 5, 5]
    assert cache.get_mask_sizes(1, 2) == (6, 0)
    assert cache.is_sliding == [False, True, False]
    assert cache.is_croppable is False and cache.is_compileable is False and cache.is_initialized
    assert cache.batch_size == 3 and cache.max_batch_size == 3 and len(cache) == 3
    assert cache.nbytes() == sum(cache.layer_nbytes()) > 0
    with pytest.raises(TypeError, match="MixerStateLayer.update"):
        cache.update(torch.zeros(1), torch.zeros(1), 0)


def test_recurrent_only_cache_reports_its_length() -> None:
    """transformers' own cache raises here (no attention layer); generate() needs this to work."""
    cache = RecAttnCache(["recurrent"] * 3)
    for layer in cache.layers:
        layer.update(_states()["recurrent"], 7)
    assert cache.get_seq_length() == 7


@pytest.mark.parametrize("kind", ["kv", "window", "recurrent"])
def test_batch_ops_move_whole_rows(kind: str) -> None:
    state = _states()[kind]
    layer = MixerStateLayer(kind, 0)
    layer.update(dict(state), 5)
    layer.reorder_cache(torch.tensor([2, 0, 0]))
    for name, t in layer.state.items():
        assert torch.equal(t, state[name][[2, 0, 0]])
    layer.batch_select_indices(torch.tensor([1, 2]))
    for name, t in layer.state.items():
        assert torch.equal(t, state[name][[0, 0]])
    layer.batch_repeat_interleave(3)
    for name, t in layer.state.items():
        assert torch.equal(t, state[name][[0] * 6])
    assert layer.batch_size == 6 and layer.get_seq_length() == 5


# ----- crop ------------------------------------------------------------------------------------------------
def test_crop_kv_removes_tokens() -> None:
    layer = MixerStateLayer("kv", 0)
    state = _states()["kv"]
    layer.update(dict(state), 5)
    layer.crop(0)  # transformers' no-op
    assert layer.get_seq_length() == 5
    layer.crop(-2)
    assert layer.get_seq_length() == 3 and torch.equal(layer.state["k"], state["k"][:, :, :3])
    layer.crop(2)  # legacy form: keep the first 2
    assert layer.get_seq_length() == 2 and layer.state["v"].shape[2] == 2
    with pytest.raises(ValueError, match="layer 0: cannot remove 3 tokens from a cache holding 2"):
        layer.crop(-3)


def test_crop_window_only_before_it_drops_tokens() -> None:
    layer = MixerStateLayer("window", 4)
    layer.update({"k": torch.rand(1, 2, 2, 4), "v": torch.rand(1, 2, 2, 4)}, 2)  # window not full yet
    layer.crop(-1)
    assert layer.get_seq_length() == 1 and layer.state["k"].shape[2] == 1
    layer.update({"k": torch.rand(1, 2, 3, 4), "v": torch.rand(1, 2, 3, 4)}, 4)  # 5 seen, 3 kept
    with pytest.raises(ValueError, match="layer 4: cannot crop a state whose window already dropped tokens"):
        layer.crop(-1)


def test_crop_recurrent_is_refused_and_leaves_the_cache_unchanged() -> None:
    cache = _filled_cache()  # kv, window (3 of 5 tokens kept), recurrent
    before = [dict(layer.state) for layer in cache.layers]
    with pytest.raises(ValueError, match="layer 1: cannot crop a state whose window already dropped tokens"):
        cache.crop(-1)
    cache.layers.pop(1)
    with pytest.raises(ValueError, match="layer 2: cannot crop a recurrent state from 5 to 4 tokens"):
        cache.crop(-1)
    cache.layers.insert(1, MixerStateLayer("window", 1))
    cache.layers[1].update(before[1], 5)
    for layer, state in zip(cache.layers, before, strict=True):
        assert layer.get_seq_length() == 5
        assert all(layer.state[name] is t for name, t in state.items())
    cache.crop(0)  # removing nothing is always fine
    assert cache.get_seq_length() == 5


def test_crop_of_a_softmax_model_cache_rolls_back() -> None:
    """crop + decode equals decoding the shorter prompt (what assisted decoding relies on for KV caches)."""
    model = tiny_model(Case("softmax", {"mixer": "softmax"}))
    ids, mask = left_padded_batch()
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        cache.crop(-2)
        width = ids.shape[1] - 2
        got = model(ids[:, width : width + 1], attention_mask=mask[:, : width + 1], past_key_values=cache,
                    use_cache=True).logits
        want = model(ids[:, : width + 1], attention_mask=mask[:, : width + 1]).logits[:, -1:]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ----- batch operations on real model states ---------------------------------------------------------------
def _prefilled(model, ids, mask):  # noqa: ANN001, ANN202
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    return cache


def _next_logits(model, cache, token, mask):  # noqa: ANN001, ANN202
    with torch.no_grad():
        return model(token, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]


@pytest.mark.parametrize("case", CASES)
def test_reorder_select_repeat_match_a_fresh_run(case: Case) -> None:
    """A batch operation on a filled cache, then a step == prefill of the rearranged batch, then a step."""
    model = tiny_model(case)
    ids, mask = left_padded_batch()
    token = torch.tensor([[5], [9], [13]])
    step_mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
    for op, rows in (("reorder_cache", [2, 0, 0]), ("batch_select_indices", [2, 0]),
                     ("batch_repeat_interleave", [0, 0, 1, 1, 2, 2])):
        cache = _prefilled(model, ids, mask)
        arg = 2 if op == "batch_repeat_interleave" else torch.tensor(rows)
        getattr(cache, op)(arg)
        assert cache.batch_size == len(rows)
        got = _next_logits(model, cache, token[rows], step_mask[rows])
        want = _next_logits(model, _prefilled(model, ids[rows], mask[rows]), token[rows], step_mask[rows])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=op)


# ----- constant memory -------------------------------------------------------------------------------------
def _bytes_after(model, tokens: int, chunk: int = 512) -> tuple[list[int], RecAttnCache]:  # noqa: ANN001
    cache = model.new_cache()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for start in range(0, tokens, chunk):
            n = min(chunk, tokens - start)
            model(torch.randint(1, 64, (1, n), generator=gen), past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
    return cache.layer_nbytes(), cache


@pytest.mark.parametrize("case", CASES)
def test_state_bytes_after_64_and_4096_tokens(case: Case) -> None:
    """Recurrent and window layers hold the same bytes after 64 and 4,096 tokens; KV layers grow by the same bytes
    for every 64 tokens (64-fold for a plain KV cache; retrieval heads add a fixed window beside it)."""
    model = tiny_model(case, max_positions=4096)
    short, _ = _bytes_after(model, 64)
    double, _ = _bytes_after(model, 128)
    long, cache = _bytes_after(model, 4096)
    assert cache.get_seq_length() == 4096
    for i, (kind, a, b) in enumerate(zip(kinds(model), short, long, strict=True)):
        assert a > 0
        if kind == "kv":
            assert b - a == 63 * (double[i] - a) > 0, f"layer {i}"
            if model.model.layers[i].self_attn.mixer.state_size(0) == 0:
                assert b == 64 * a, f"layer {i}"
        else:
            assert b == a, f"layer {i} ({kind}): {a} bytes after 64 tokens, {b} after 4096"
        mixer = model.model.layers[i].self_attn.mixer
        assert sum(t.numel() for t in cache.layers[i].state.values()) == mixer.state_size(4096), f"layer {i}"


def test_the_cache_is_taken_under_either_name() -> None:
    """transformers up to 5.23 hands the cache to a forward as ``past_key_values``, 5.24 as ``cache``: both fill
    the given cache, the output carries it under this release's name, and both at once are refused."""
    model = tiny_model(next(case for case in all_cases() if case.id == "linear(feature_map=elu)"))
    ids = torch.tensor([[3, 8, 5, 2]])
    old, new = model.new_cache(), model.new_cache()
    with torch.no_grad():
        by_old = model(ids, past_key_values=old, use_cache=True)
        by_new = model(ids, cache=new, use_cache=True)
        assert cache_of(by_old) is old and cache_of(by_new) is new and getattr(by_new, CACHE_NAME) is new
        assert new.get_seq_length() == old.get_seq_length() == ids.shape[1]
        assert torch.equal(by_old.logits, by_new.logits)
        with pytest.raises(ValueError, match="pass the cache once"):
            model(ids, past_key_values=model.new_cache(), cache=model.new_cache())
