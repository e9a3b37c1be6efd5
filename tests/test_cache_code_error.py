"""benchmarks/cache_code_error.py: the attention it compares is the model's own, and its errors measure the codes."""

from __future__ import annotations

import torch
from generation_cases import Case, tiny_model
from script_modules import load_script

error = load_script("benchmarks", "cache_code_error")


def test_the_captured_layers_attend_as_the_model_does() -> None:
    """Every layer's queries, keys and values as captured, put through the benchmark's attention over all positions
    (a softmax layer and a sliding one of 3 tokens), give that layer's mixer output: what is compared is the
    model's attention, after RoPE, with its KV head groups and windows."""
    model = tiny_model(Case("mixed", [{"mixer": "softmax"}, {"mixer": "sliding_window", "window": 3}]))
    block = torch.randint(1, 60, (1, 10), generator=torch.Generator().manual_seed(0))
    outputs = {}
    hooks = [layer.self_attn.mixer.register_forward_hook(
        lambda _m, _a, out, i=i: outputs.__setitem__(i, out[0][0].detach())) for i, layer in
        enumerate(model.model.layers)]
    captured = error.capture_layers(model, block)
    for hook in hooks:
        hook.remove()
    for index, window in ((0, None), (1, 3)):
        q, k, v = captured[index]
        assert q.shape == (4, 10, 8) and k.shape == v.shape == (2, 10, 8)
        weights, out = error.attention(q, k, v, window)
        assert torch.allclose(out.float(), outputs[index].transpose(0, 1), atol=1e-5)  # the mixer's [T, H, D]
        if window:
            assert not weights[:, 5, :3].any() and weights[:, 5, 3:6].all()  # the query at 5 sees 3, 4, 5


def test_errors_grow_as_the_codes_coarsen() -> None:
    """Keys and values that int8 holds exactly (integers within 127) cost int8 nothing; on random vectors with
    one large coordinate per head, int4's attention and output errors exceed int8's, and int4g16 (a scale per 16
    dimensions) errs less than int4 (per 32). k8v4g16 holds the keys as int8 does (the same attention weights and
    key error) and the values as int4g16 does: its output errs between int8's and int4g16's."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 40, 32, generator=gen)
    exact_k = torch.randint(-127, 128, (2, 40, 32), generator=gen).float()
    exact_k[..., 0] = 127.0
    exact = error.layer_errors(q / 100, exact_k, exact_k.clone(), None, 8)
    assert exact["int8"] == {"attention_l1": 0.0, "output_rel": 0.0, "key_rel": 0.0}
    k, v = torch.randn(2, 40, 32, generator=gen), torch.randn(2, 40, 32, generator=gen)
    k[..., 3] *= 12.0
    errors = error.layer_errors(q, k, v, None, 8)
    for metric in ("attention_l1", "output_rel", "key_rel"):
        assert 0 < errors["int8"][metric] < errors["int4g16"][metric] < errors["int4"][metric], metric
    for metric in ("attention_l1", "key_rel"):
        assert errors["k8v4g16"][metric] == errors["int8"][metric]
    assert errors["int8"]["output_rel"] < errors["k8v4g16"]["output_rel"] < errors["int4g16"]["output_rel"]
