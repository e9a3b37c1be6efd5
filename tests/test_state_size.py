"""state_size_report and ``hf-recattn state-size``: sizes, break-even contexts, table, JSON, errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_recattn import RecAttnConfig, RecAttnForCausalLM, state_size_report
from hf_recattn.cli import main
from hf_recattn.state_size import format_report

D, HKV = 64, 2
KV_PER_TOKEN = 2 * HKV * D
LAYERS = [
    {"mixer": "softmax"},
    {"mixer": "sliding_window", "window": 128},
    {"mixer": "linear", "feature_map": "taylor2"},
    {"mixer": "linear", "feature_map": "elu"},
    {"mixer": "linear", "feature_map": "hedgehog", "normalize": "rms"},
]


def config(attention: object = None) -> RecAttnConfig:
    return RecAttnConfig(
        vocab_size=100,
        hidden_size=4 * D,
        intermediate_size=64,
        num_hidden_layers=len(LAYERS),
        num_attention_heads=4,
        num_key_value_heads=HKV,
        attention=attention or LAYERS,
    )


def test_taylor2_breaks_even_near_1090_tokens_per_kv_head() -> None:
    rows = state_size_report(config(), 4096)
    taylor = rows[2]
    features = 1 + D + D * (D + 1) // 2  # 2145: constant, linear and packed symmetric quadratic terms
    per_head = features * (D + 1)  # S (features x d) and z (features)
    assert taylor.state_elements == HKV * per_head == 278_850
    assert taylor.kind == "recurrent"
    assert taylor.break_even_context == math.ceil(per_head / (2 * D)) == 1090
    # at the break-even context the KV cache is at least as large as the state, one token earlier it is not
    assert KV_PER_TOKEN * 1090 >= taylor.state_elements > KV_PER_TOKEN * 1089


def test_first_order_maps_break_even_at_33_and_hedgehog_at_65() -> None:
    rows = state_size_report(config(), 10)
    assert rows[3].break_even_context == 33  # d (d + 1) / 2d
    assert rows[4].break_even_context == 65  # 2d features: 2d (d + 1) / 2d


def test_softmax_never_breaks_even_and_grows() -> None:
    short, long = state_size_report(config(), 100)[0], state_size_report(config(), 10_000)[0]
    assert short.kind == "kv" and short.break_even_context is None
    assert short.state_elements == short.kv_cache_elements == 100 * KV_PER_TOKEN
    assert long.state_elements == 10_000 * KV_PER_TOKEN


def test_window_is_bounded() -> None:
    sizes = [state_size_report(config(), n)[1] for n in (10, 127, 128, 100_000)]
    assert [r.kind for r in sizes] == ["window"] * 4
    assert sizes[0].state_elements == 10 * KV_PER_TOKEN
    assert sizes[1].state_elements == sizes[2].state_elements == sizes[3].state_elements == 127 * KV_PER_TOKEN
    assert sizes[3].break_even_context == 127


def test_the_teachers_sliding_layers_hold_their_window_beside_the_state() -> None:
    """A teacher that slid layers 1 and 2 (window 128: 127 cached pairs) holds no more there at any context; its
    full layers grow. A state larger than such a layer's window never breaks even with it."""
    windowed = config()
    windowed.teacher_kv_windows = [None, 128, 128, None, None]
    for context in (10, 127, 128, 100_000):
        plain, rows = state_size_report(config(), context), state_size_report(windowed, context)
        held = min(context, 127)
        want = (context, held, held, context, context)
        assert [r.kv_cache_elements for r in rows] == [KV_PER_TOKEN * n for n in want]
        assert [r.state_elements for r in rows] == [r.state_elements for r in plain]
    rows = state_size_report(windowed, 4096)
    assert rows[1].kv_cache_elements == rows[1].state_elements  # the teacher's own window kept: ratio 1
    assert rows[2].break_even_context is None  # taylor2 needs 1,090 pairs; the teacher keeps 127 here
    assert rows[1].break_even_context == 127 and rows[3].break_even_context == 33


def test_teacher_kv_windows_is_checked_by_name() -> None:
    for bad in ([None] * 4, [None, 1, None, None, None], [None, True, None, None, None], "128"):
        with pytest.raises(ValueError, match="teacher_kv_windows"):
            config_with_windows(bad)


def config_with_windows(windows: object) -> RecAttnConfig:
    return RecAttnConfig(vocab_size=100, hidden_size=4 * D, intermediate_size=64, num_hidden_layers=len(LAYERS),
                         num_attention_heads=4, num_key_value_heads=HKV, attention=LAYERS, teacher_kv_windows=windows)


def test_forget_factors_add_one_float_per_cached_key_and_query_head() -> None:
    """ALiBi / FoX: the KV cache plus c (cumulative log-forget) per cached key and query head (4 heads)."""
    specs = [{"mixer": "softmax", "forget": "fox"}, {"mixer": "sliding_window", "window": 128, "forget": "alibi"}]
    rows = state_size_report(config(specs + LAYERS[2:]), 1000)
    assert [r.kind for r in rows[:2]] == ["kv", "window"]
    assert rows[0].state_elements == 1000 * (KV_PER_TOKEN + 4) and rows[0].break_even_context is None
    assert rows[1].state_elements == 127 * (KV_PER_TOKEN + 4)


def test_recurrent_state_does_not_grow() -> None:
    a, b = state_size_report(config(), 1), state_size_report(config(), 1_000_000)
    for i in (2, 3, 4):
        assert a[i].state_elements == b[i].state_elements
        assert b[i].kv_cache_elements == 1_000_000 * KV_PER_TOKEN


DELTA_LAYERS = [  # (spec, conv taps W, Householder steps n)
    ("gdn", 4, 1),
    ({"mixer": "gdn", "conv_size": 0}, 0, 1),
    ("comba", 4, 1),
    ({"mixer": "deltanet", "conv_size": 2}, 2, 1),
    ("deltaproduct", 4, 2),
    ({"mixer": "deltaproduct", "conv_size": 0}, 0, 2),
]


def delta_elements(taps: int, steps: int, heads: int = 4) -> int:
    """S (d x d per KV head) plus the last W - 1 convolution inputs of q (H d), k and v (n Hkv d each)."""
    conv = max(taps - 1, 0) * (heads * D + 2 * steps * HKV * D)
    return HKV * D * D + conv


def test_delta_layers_hold_the_matrix_state_and_the_conv_inputs() -> None:
    cfg = RecAttnConfig(
        vocab_size=100, hidden_size=4 * D, intermediate_size=64, num_hidden_layers=len(DELTA_LAYERS),
        num_attention_heads=4, num_key_value_heads=HKV, attention=[spec for spec, _, _ in DELTA_LAYERS],
    )
    want = [delta_elements(taps, steps) for _, taps, steps in DELTA_LAYERS]
    assert want[:2] == [8192 + 3 * (256 + 256), 8192] and want[4] == 8192 + 3 * (256 + 512)
    for context in (1, 4096, 1_000_000):
        rows = state_size_report(cfg, context)
        assert [r.state_elements for r in rows] == want
        assert {(r.mixer, r.kind) for r in rows} == {("delta", "recurrent")}
    assert [r.break_even_context for r in rows] == [math.ceil(n / KV_PER_TOKEN) for n in want]
    # the cache a real prefill leaves holds exactly that many elements per layer
    model = RecAttnForCausalLM(cfg).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 100, (1, 5)), past_key_values=cache, use_cache=True)
    assert [sum(t.numel() for t in layer.state.values()) for layer in cache.layers] == want


def test_feedback_softmax_layers_are_kv_caches() -> None:
    """DeltaFormer keeps every key and its u (a KV cache); PaTH every carried key, value and a 1-element stamp."""
    cfg = RecAttnConfig(
        vocab_size=100, hidden_size=4 * D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=HKV, attention=["deltaformer", "path"],
    )
    for context in (1, 4096):
        rows = state_size_report(cfg, context)
        assert [(r.mixer, r.kind) for r in rows] == [("softmax_delta", "kv"), ("softmax_householder", "kv")]
        assert [r.state_elements for r in rows] == [KV_PER_TOKEN * context, (KV_PER_TOKEN + 1) * context]
        assert rows[0].break_even_context is None
    model = RecAttnForCausalLM(cfg).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 100, (1, 5)), past_key_values=cache, use_cache=True)
    assert [sum(t.numel() for t in layer.state.values()) for layer in cache.layers] == [
        5 * KV_PER_TOKEN, 5 * (KV_PER_TOKEN + 1)
    ]


def test_mesa_layers_hold_G_H_and_the_conv_inputs() -> None:
    """MesaNet: G (d x d) and H (d x d) per KV head plus the last W - 1 convolution inputs of q (H d) and k (Hkv d)."""
    specs = ["mesanet", {"mixer": "mesanet", "conv_size": 0}]
    cfg = RecAttnConfig(
        vocab_size=100, hidden_size=4 * D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=HKV, attention=specs,
    )
    want = [2 * HKV * D * D + 3 * (4 * D + HKV * D), 2 * HKV * D * D]
    assert want == [16384 + 3 * 384, 16384]
    for context in (1, 1_000_000):
        rows = state_size_report(cfg, context)
        assert [r.state_elements for r in rows] == want
        assert {(r.mixer, r.kind) for r in rows} == {("mesa", "recurrent")}
    model = RecAttnForCausalLM(cfg).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 100, (1, 5)), past_key_values=cache, use_cache=True)
    assert [sum(t.numel() for t in layer.state.values()) for layer in cache.layers] == want


def test_gla_and_retnet_layers_hold_one_matrix_per_kv_head() -> None:
    """GLA: S (d x d) per KV head; RetNet (linear, identity map): S (d x d) and z (d) per KV head."""
    cfg = RecAttnConfig(
        vocab_size=100, hidden_size=4 * D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=HKV, attention=["gla", "retnet"],
    )
    want = [HKV * D * D, HKV * D * (D + 1)]
    for context in (1, 1_000_000):
        rows = state_size_report(cfg, context)
        assert [r.state_elements for r in rows] == want
        assert [(r.mixer, r.kind) for r in rows] == [("gated_linear", "recurrent"), ("linear", "recurrent")]
    assert [r.break_even_context for r in rows] == [32, 33]
    model = RecAttnForCausalLM(cfg).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 100, (1, 5)), past_key_values=cache, use_cache=True)
    assert [sum(t.numel() for t in layer.state.values()) for layer in cache.layers] == want


def test_bad_context_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="context length must be >= 1, got 0"):
        state_size_report(config(), 0)


def test_format_report_table() -> None:
    text = format_report(state_size_report(config(), 4096), bytes_per_element=2)
    lines = text.splitlines()
    assert lines[0].split() == ["layer", "mixer", "kind", "state", "teacher", "kv", "break-even"]
    assert len(lines) == 1 + len(LAYERS) + 1
    assert lines[3].split() == ["2", "linear", "recurrent", "278,850", "1,048,576", "1090"]
    assert lines[1].split()[-1] == "-"
    total_kv = len(LAYERS) * 4096 * KV_PER_TOKEN * 2 / 2**20
    assert f"teacher's kv cache {total_kv:.2f} MiB" in lines[-1] and "2 bytes per element" in lines[-1]


# ----- the command line -------------------------------------------------------------------------------------
@pytest.fixture
def folder(tmp_path: Path) -> Path:
    config().save_pretrained(tmp_path)
    return tmp_path


def test_cli_table_from_folder_and_config_json(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["state-size", str(folder), "--context", "4096"]) == 0
    table = capsys.readouterr().out
    assert "1090" in table and "taylor" not in table and "linear" in table
    assert main(["state-size", str(folder / "config.json"), "--context", "4096"]) == 0
    assert capsys.readouterr().out == table


def test_cli_json_and_inline_config(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["state-size", str(folder), "--context", "2000", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["mixer"] for r in rows] == [s["mixer"] for s in LAYERS]
    assert rows[2]["break_even_context"] == 1090 and rows[0]["break_even_context"] is None
    assert (
        rows[1]["state_elements"] == 127 * KV_PER_TOKEN
        and rows[0]["kv_cache_elements"] == 2000 * KV_PER_TOKEN
    )
    inline = json.dumps(
        {
            "num_hidden_layers": 1,
            "hidden_size": 4 * D,
            "num_attention_heads": 4,
            "num_key_value_heads": HKV,
            "attention": {"mixer": "linear", "feature_map": "taylor2"},
        }
    )
    assert main(["state-size", inline, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["break_even_context"] == 1090


def test_cli_missing_path_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"
    assert main(["state-size", str(missing)]) == 2
    assert f"error: {missing}: not a checkpoint folder (no config.json)" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["state-size", str(tmp_path / "config.json")]) == 2
    assert "model_type is 'llama', not 'recattn'" in capsys.readouterr().err


def test_cli_bad_input_is_one_line_not_a_traceback(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["state-size", str(folder), "--context", "0"]) == 2
    assert "error: context length must be >= 1" in capsys.readouterr().err
    data = json.loads((folder / "config.json").read_text())
    data["attention"][2]["feature_map"] = "taylor9"
    (folder / "config.json").write_text(json.dumps(data))
    assert main(["state-size", str(folder)]) == 2
    assert "layer 2: option 'feature_map'" in capsys.readouterr().err


def test_console_script(folder: Path) -> None:
    """The installed entry point, as a user runs it (one subprocess: imports torch once)."""
    script = Path(sys.executable).with_name("hf-recattn")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "hf_recattn.cli"]
    ok = subprocess.run(
        [*command, "state-size", str(folder), "--context", "4096"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[3].split()[-1] == "1090"
