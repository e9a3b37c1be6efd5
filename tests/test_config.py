"""RecAttnConfig: per-layer specs (one spec, overrides, a list, a name), validation errors, round trips."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
from transformers import AutoConfig

from hf_recattn import RecAttnConfig
from hf_recattn.modeling import configuration
from hf_recattn.modeling.configuration import read_checkpoint_config
from hf_recattn.modeling.mixers import validate_spec
from hf_recattn.modeling.modeling import RecAttnForCausalLM

LINEAR = {"mixer": "linear", "feature_map": "hedgehog", "normalize": "rms"}
WINDOW = {"mixer": "sliding_window", "window": 16}


def config(
    attention: object = None, overrides: dict | None = None, layers: int = 6, **kw: object
) -> RecAttnConfig:
    values = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    values.update(kw)
    return RecAttnConfig(**values, attention=attention, attention_overrides=overrides)


def mixers(cfg: RecAttnConfig) -> list[str]:
    return [s["mixer"] for s in cfg.layer_specs()]


# ----- valid forms ------------------------------------------------------------------------------------------
def test_default_is_softmax_everywhere() -> None:
    assert mixers(config()) == ["softmax"] * 6


def test_one_spec_for_all_layers_with_defaults_filled() -> None:
    specs = config(LINEAR).layer_specs()
    assert len(specs) == 6
    for spec in specs:
        assert spec["feature_map"] == "hedgehog" and spec["normalize"] == "rms"
        assert spec["chunk_size"] == 64 and spec["causal"] is True and spec["rope"] is True  # defaults


def test_a_mixer_name_string() -> None:
    cfg = config("sliding_window")
    assert mixers(cfg) == ["sliding_window"] * 6 and cfg.layer_spec(3)["window"] == 64


def test_per_layer_list() -> None:
    specs = [LINEAR, "softmax", WINDOW, {"mixer": "linear"}, "softmax", WINDOW]
    assert mixers(config(specs)) == [
        "linear",
        "softmax",
        "sliding_window",
        "linear",
        "softmax",
        "sliding_window",
    ]


@pytest.mark.parametrize(
    "key,layers",
    [
        ("0", [0]),
        ("4", [4]),
        ("-1", [5]),
        ("-6", [0]),
        ("every:2", [1, 3, 5]),
        ("every:3", [2, 5]),
        ("every:4:0", [0, 4]),
        ("every:3:1", [1, 4]),
        ("every:1", [0, 1, 2, 3, 4, 5]),
    ],
)
def test_override_keys_pick_layers(key: str, layers: list[int]) -> None:
    cfg = config(LINEAR, {key: {"mixer": "softmax"}})
    assert [i for i, m in enumerate(mixers(cfg)) if m == "softmax"] == layers


def test_explicit_index_wins_over_a_pattern_and_int_keys_work() -> None:
    cfg = config(LINEAR, {"every:2": "softmax", 3: WINDOW})  # an int key, as a user might write it in Python
    assert mixers(cfg) == ["linear", "softmax", "linear", "sliding_window", "linear", "softmax"]
    assert cfg.layer_spec(3)["window"] == 16


def test_overrides_apply_on_top_of_a_list() -> None:
    cfg = config(["softmax"] * 6, {"-1": LINEAR})
    assert mixers(cfg) == ["softmax"] * 5 + ["linear"]


def test_user_specs_are_not_mutated() -> None:
    spec = dict(LINEAR)
    cfg = config(spec, {"0": spec})
    cfg.layer_specs()
    assert spec == LINEAR


# ----- each spec validated once per config ------------------------------------------------------------------
def _count_validations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every spec the configuration module validates."""
    seen: list[str] = []

    def counting(spec: object, where: str) -> dict:
        seen.append(where)
        return validate_spec(spec, where)

    monkeypatch.setattr(configuration, "validate_spec", counting)
    return seen


@pytest.mark.parametrize("layers", [2, 10, 30])
def test_building_a_model_validates_each_layer_spec_once(monkeypatch: pytest.MonkeyPatch, layers: int) -> None:
    seen = _count_validations(monkeypatch)
    cfg = config(LINEAR, {"every:3": "softmax"}, layers=layers)
    with torch.device("meta"):
        RecAttnForCausalLM(cfg)
    for _ in range(3):  # properties and copies read the resolved specs, they do not resolve them again
        cfg.layer_types, cfg.layer_specs(), cfg.layer_spec(layers - 1)
    assert seen == [f"layer {i}" for i in range(layers)]


def test_setting_an_input_resolves_the_specs_again(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(LINEAR)
    seen = _count_validations(monkeypatch)
    cfg.attention = ["softmax"] * 6
    assert mixers(cfg) == ["softmax"] * 6 and cfg.layer_types == ["full_attention"] * 6 and len(seen) == 6
    cfg.attention_overrides = {"0": WINDOW}
    assert mixers(cfg)[:2] == ["sliding_window", "softmax"] and len(seen) == 12
    cfg.num_hidden_layers = 4
    with pytest.raises(ValueError, match=r"one spec per layer \(4\), got 6"):
        cfg.layer_specs()
    cfg.attention = "linear"
    assert mixers(cfg) == ["sliding_window"] + ["linear"] * 3 and len(seen) == 16


def test_resolved_specs_are_not_shared_or_saved() -> None:
    cfg = config(LINEAR)
    cfg.layer_specs()[0]["mixer"] = "softmax"
    cfg.layer_spec(1)["feature_map"] = "elu"
    assert mixers(cfg) == ["linear"] * 6 and cfg.layer_spec(1)["feature_map"] == "hedgehog"
    assert "_resolved_specs" not in cfg.to_dict() and cfg == config(LINEAR)
    for other in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert other == cfg and other.layer_specs() == cfg.layer_specs()


# ----- invalid specs: ValueError naming the layer and the option --------------------------------------------
@pytest.mark.parametrize(
    "attention,overrides,pattern",
    [
        ({"mixer": "nope"}, None, r"layer 0: unknown mixer 'nope'"),
        ("nope", None, r"layer 0: unknown mixer 'nope'"),
        ({"feature_map": "elu"}, None, r"layer 0: a spec must be a dict with a 'mixer' key"),
        (5, None, r"layer 0: a spec must be a dict"),
        ({"mixer": "linear", "featuremap": "elu"}, None, r"layer 0: unknown option\(s\) \['featuremap'\]"),
        ({"mixer": "softmax", "window": 4}, None, r"layer 0: unknown option\(s\) \['window'\]"),
        ({"mixer": "linear", "feature_map": "gauss"}, None, r"layer 0: option 'feature_map' must be one of"),
        ({"mixer": "linear", "normalize": "sum"}, None, r"layer 0: option 'normalize' must be one of"),
        ({"mixer": "sliding_window", "window": "8"}, None, r"layer 0: option 'window' must be int"),
        ({"mixer": "sliding_window", "window": 8.0}, None, r"layer 0: option 'window' must be int"),
        ({"mixer": "sliding_window", "window": True}, None, r"layer 0: option 'window' must be int"),
        ({"mixer": "linear", "causal": 1}, None, r"layer 0: option 'causal' must be bool"),
        ({"mixer": "linear", "eps": "1e-6"}, None, r"layer 0: option 'eps' must be float"),
        ({"mixer": "softmax", "rope": "yes"}, None, r"layer 0: option 'rope' must be bool"),
        ({"mixer": "sliding_window", "window": 0}, None, r"layer 0: option 'window' must be >= 1"),
        ({"mixer": "linear", "chunk_size": 0}, None, r"layer 0: option 'chunk_size' must be >= 1"),
        ({"mixer": "linear", "eps": -1.0}, None, r"layer 0: option 'eps' must be >= 0"),
        ("softmax", {"4": {"mixer": "linear", "normalize": "max"}}, r"layer 4: option 'normalize'"),
        ("softmax", {"-1": {"mixer": "sliding_window", "window": -2}}, r"layer 5: option 'window'"),
        (
            "softmax",
            {"every:3": {"mixer": "linear", "bogus": 1}},
            r"layer 2: unknown option\(s\) \['bogus'\]",
        ),
        (
            ["softmax"] * 3 + [{"mixer": "linear", "chunk_size": 2.5}] + ["softmax"] * 2,
            None,
            r"layer 3: option 'chunk_size' must be int",
        ),
    ],
)
def test_invalid_spec_names_layer_and_option(attention: object, overrides: dict | None, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        config(attention, overrides)


@pytest.mark.parametrize("length", [5, 7, 0])
def test_list_of_wrong_length(length: int) -> None:
    with pytest.raises(ValueError, match=rf"attention: a list needs one spec per layer \(6\), got {length}"):
        config(["softmax"] * length)


@pytest.mark.parametrize(
    "key", ["6", "-7", "x", "every:0", "every:4:4", "every:4:-1", "every:a", "every:2:1:0", "every:", "1.5"]
)
def test_bad_override_key(key: str) -> None:
    with pytest.raises(ValueError, match=rf"attention_overrides\[{key!r}\]"):
        config("softmax", {key: "linear"})


def test_overrides_must_be_a_dict() -> None:
    with pytest.raises(ValueError, match="attention_overrides must be a dict"):
        config("softmax", [("0", "linear")])  # type: ignore[arg-type]


def test_heads_must_divide() -> None:
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"
    ):
        config(num_key_value_heads=3)


# ----- round trips ------------------------------------------------------------------------------------------
def _mixed() -> RecAttnConfig:
    return config(
        [LINEAR, "softmax", WINDOW, "linear", "softmax", "softmax"],
        {"every:3:0": {"mixer": "linear", "feature_map": "taylor2", "normalize": "l2", "chunk_size": 8}},
    )


def test_to_dict_from_dict_round_trip() -> None:
    cfg = _mixed()
    data = cfg.to_dict()
    assert data["model_type"] == "recattn"
    back = RecAttnConfig.from_dict(json.loads(json.dumps(data)))
    assert back.layer_specs() == cfg.layer_specs()
    assert back.attention == cfg.attention and back.attention_overrides == cfg.attention_overrides


def test_save_pretrained_round_trip(tmp_path) -> None:  # noqa: ANN001
    cfg = _mixed()
    cfg.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "recattn" and saved["attention_overrides"] == {
        "every:3:0": cfg.attention_overrides["every:3:0"]
    }
    for loaded in (RecAttnConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)):
        assert type(loaded) is RecAttnConfig
        assert loaded.layer_specs() == cfg.layer_specs()
        assert [s["mixer"] for s in loaded.layer_specs()] == [
            "linear",
            "softmax",
            "sliding_window",
            "linear",
            "softmax",
            "softmax",
        ]
        assert loaded.layer_spec(3)["feature_map"] == "taylor2"


def test_a_bad_saved_config_fails_on_load(tmp_path) -> None:  # noqa: ANN001
    config().save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["attention_overrides"] = {"2": {"mixer": "linear", "feature_map": "nope"}}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"layer 2: option 'feature_map'"):
        AutoConfig.from_pretrained(tmp_path)


def test_read_checkpoint_config_from_folder_or_file(tmp_path) -> None:  # noqa: ANN001
    cfg = _mixed()
    cfg.save_pretrained(tmp_path)
    for path in (tmp_path, tmp_path / "config.json", str(tmp_path)):
        loaded = read_checkpoint_config(path)
        assert type(loaded) is RecAttnConfig and loaded.layer_specs() == cfg.layer_specs()
        assert loaded.to_dict() == RecAttnConfig.from_pretrained(tmp_path).to_dict()
    with pytest.raises(ValueError, match=r"nowhere: not a checkpoint folder \(no config\.json\)"):
        read_checkpoint_config(tmp_path / "nowhere")
    for text, says in (("{", "not valid JSON"), ("[1]", "not a JSON object"),
                       ('{"model_type": "llama"}', "model_type is 'llama', not 'recattn'")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ValueError, match=rf"config\.json: {says}"):
            read_checkpoint_config(tmp_path)
