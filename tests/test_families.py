"""Every Llama-variant teacher family, as tiny random instances of transformers' own classes: softmax passthrough
equals the teacher (logits and greedy tokens through the cache), save + load with and without the package, the
architecture options under recurrent mixers through the cache, recipes that convert only some teacher layers,
and the bad-input errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from distill_fixtures import tiny_corpus_file, tiny_recipe_dict, tiny_tokenizer, write_recipe
from isolated import HIDE_HF_RECATTN
from transformers import AutoConfig, AutoModelForCausalLM

from hf_recattn import RecAttnConfig, RecAttnForCausalLM, evaluation, from_teacher
from hf_recattn.cli import main
from hf_recattn.conversion.attention_transfer import attention_transfer, softmax_twins
from hf_recattn.conversion.from_teacher import recattn_config_from
from hf_recattn.conversion.recipe import check_against_teacher, recipe_from_dict
from hf_recattn.conversion.settings import Stage1Settings
from hf_recattn.state_size import format_report, state_size_report
from hf_recattn.training.attention_objective import teacher_attention_io

VOCAB = 100
ATOL = 1e-5
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ALTERNATE = ["sliding_attention", "full_attention"] * 2
ROPE = {"rope_theta": 10000.0}
#: id -> (model_type, config options): together every option the families have
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-linear": ("llama", {"rope_parameters": {**ROPE, "rope_type": "linear", "factor": 2.0}}),
    "llama-dynamic": ("llama", {"rope_parameters": {**ROPE, "rope_type": "dynamic", "factor": 2.0}}),
    "llama-yarn": ("llama", {"rope_parameters": {**ROPE, "rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 16}}),
    "llama-llama3": ("llama", {"rope_parameters": {**ROPE, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "llama-longrope": ("llama", {"rope_parameters": {**ROPE, "rope_type": "longrope",
                                                     "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                     "long_factor": [2.0, 3.0, 5.0, 8.0],
                                                     "original_max_position_embeddings": 8}}),
    "mistral-window": ("mistral", {"sliding_window": 5}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2}),
    "qwen3": ("qwen3", {"use_sliding_window": True, "sliding_window": 5, "layer_types": ALTERNATE}),
    "smollm3-nope": ("smollm3", {"no_rope_layer_interval": 2, "use_sliding_window": True, "sliding_window": 5}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
                            "logits_scaling": 4.0}),
    "phi3": ("phi3", {"rope_parameters": {**ROPE, "rope_type": "default", "partial_rotary_factor": 0.5},
                      "sliding_window": 6}),
    "phi3-longrope": ("phi3", {"rope_parameters": {**ROPE, "rope_type": "longrope", "partial_rotary_factor": 0.5,
                                                   "short_factor": [1.0, 1.5], "long_factor": [3.0, 5.0]},
                               "original_max_position_embeddings": 8}),
    "gemma": ("gemma", {"head_dim": 16}),
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window": 5, "query_pre_attn_scalar": 8,
                          "attn_logit_softcapping": 3.0, "final_logit_softcapping": 2.0}),
    "gemma3": ("gemma3_text", {"head_dim": 16, "sliding_window": 5, "query_pre_attn_scalar": 8,
                               "layer_types": ALTERNATE, "final_logit_softcapping": 4.0,
                               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1000.0}}}),
}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def teacher(case: str, seed: int = 0, **extra: Any) -> torch.nn.Module:
    """A tiny random teacher of ``case``, every weight moved off its init (so each norm and bias shows)."""
    model_type, options = FAMILIES[case]
    config = AutoConfig.for_model(model_type, **{**BASE, **options, **extra})
    config._attn_implementation = "eager" if model_type == "gemma2" else "sdpa"  # sdpa cannot soft-cap
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def ids(batch: int = 2, length: int = 14, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model: torch.nn.Module, prompt: torch.Tensor, new: int = 12) -> torch.Tensor:
    return model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)


# ----- passthrough ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(FAMILIES))
def test_softmax_passthrough_equals_the_teacher(case: str) -> None:
    t = teacher(case)
    student = from_teacher(t, {"mixer": "softmax"})
    x = ids()  # longer than every window here: a window kept wrong (or dropped) would show
    with torch.no_grad():
        want, got = t(x).logits, student(x).logits
    assert (got - want).abs().max() <= ATOL, case
    prompt = x[:1, :4]
    assert torch.equal(greedy(student, prompt), greedy(t, prompt)), case  # token by token through the cache


@pytest.mark.parametrize("case", ["gemma", "granite"])
def test_embedding_multiplier_with_inputs_embeds(case: str) -> None:
    """Embeddings from ``get_input_embeddings()`` passed as ``inputs_embeds`` give the teacher's logits (Gemma's
    embedding module scales them, Granite's model does: the student does the latter)."""
    t = teacher(case)
    student = from_teacher(t, "softmax")
    x = ids()
    with torch.no_grad():
        want = t(inputs_embeds=t.get_input_embeddings()(x)).logits
        got = student(inputs_embeds=student.get_input_embeddings()(x)).logits
    assert (got - want).abs().max() <= ATOL


def test_teacher_windows_and_nope_layers_are_kept_per_layer() -> None:
    specs = {case: from_teacher(teacher(case), "softmax").config.layer_specs()
             for case in ("mistral-window", "qwen2-window", "qwen3", "smollm3-nope", "gemma3")}
    windows = {case: [s.get("window") for s in layer] for case, layer in specs.items()}
    assert windows["mistral-window"] == [5, 5, 5, 5]
    assert windows["qwen2-window"] == [None, None, 5, 5]  # max_window_layers=2: the first two stay full
    assert windows["qwen3"] == windows["gemma3"] == [5, None, 5, None]
    assert [s["rope"] for s in specs["smollm3-nope"]] == [True, False, True, False]  # no_rope_layers 1, 0, 1, 0
    assert windows["smollm3-nope"] == [None, 5, None, 5]  # SmolLM3 slides only its NoPE layers


def test_the_student_records_which_teacher_layers_slid_whatever_it_converts() -> None:
    """``teacher_kv_windows`` (what state reports read as the teacher's KV cache) is the teacher's window per layer
    even where the student's layer no longer slides; None for a teacher that slides nowhere."""
    gemma3 = from_teacher(teacher("gemma3"), {"mixer": "linear", "feature_map": "elu"}).config
    assert [s["mixer"] for s in gemma3.layer_specs()] == ["linear"] * 4
    assert gemma3.teacher_kv_windows == [5, None, 5, None]
    assert from_teacher(teacher("mistral-window"), "softmax").config.teacher_kv_windows == [5, 5, 5, 5]
    assert from_teacher(teacher("llama"), "softmax").config.teacher_kv_windows is None


def test_option_values_map_exactly() -> None:
    gemma3 = from_teacher(teacher("gemma3"), "softmax").config
    assert gemma3.rope_layer_groups == ALTERNATE and gemma3.qk_norm == "head" and gemma3.norm_layout == "sandwich"
    assert gemma3.attention_multiplier == 8**-0.5 and gemma3.embedding_multiplier == 32**0.5
    assert gemma3.attn_logit_softcapping is None  # in Gemma 3's config, never applied by its attention
    assert gemma3.hidden_act == "gelu_pytorch_tanh" and gemma3.norm_unit_offset
    olmo2 = from_teacher(teacher("olmo2"), "softmax").config
    assert (olmo2.norm_layout, olmo2.qk_norm) == ("post", "projection")
    qwen2 = from_teacher(teacher("qwen2-window"), "softmax").config
    assert qwen2.attention_bias and not qwen2.output_bias
    assert from_teacher(teacher("llama"), "softmax").config.attention_multiplier is None


# ----- save and load ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["gemma3", "phi3", "granite", "olmo2"])
def test_save_and_load_with_the_package(case: str, tmp_path: Path) -> None:
    student = from_teacher(teacher(case), "softmax")
    student.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, RecAttnForCausalLM)
    x = ids()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, student(x).logits)


CHILD = HIDE_HF_RECATTN + textwrap.dedent(
    r"""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    io = sys.argv[1]
    x = load_file(f"{io}/inputs.safetensors")["input_ids"]
    out = {}
    for name in sys.argv[2:]:
        model = AutoModelForCausalLM.from_pretrained(f"{io}/{name}", trust_remote_code=True).eval()
        with torch.no_grad():
            out[f"{name}.logits"] = model(x).logits.contiguous()
        out[f"{name}.tokens"] = model.generate(x[:1, :4], max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                               pad_token_id=0)
    save_file(out, f"{io}/outputs.safetensors")
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "hf_recattn")))
    """
)


def test_loads_without_the_package(tmp_path: Path) -> None:
    """Gemma 3 (rope groups, sandwich and unit-offset norms, q/k norms, attention scale, logit soft-cap) in a child
    Python where hf_recattn cannot be imported (one family: the child costs seconds)."""
    from safetensors.torch import load_file, save_file

    from hf_recattn.registration import register_auto_classes

    register_auto_classes()
    x = ids()
    save_file({"input_ids": x}, str(tmp_path / "inputs.safetensors"))
    students = {}
    for case in ("gemma3",):
        t = teacher(case)
        students[case] = (t, from_teacher(t, "softmax"))
        students[case][1].save_pretrained(tmp_path / case)
    assert (tmp_path / "gemma3" / "architecture.py").is_file()
    workdir = tmp_path / "empty"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-I", "-c", CHILD, str(tmp_path), *students], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    outputs = load_file(str(tmp_path / "outputs.safetensors"))
    for case, (t, _) in students.items():
        with torch.no_grad():
            assert (outputs[f"{case}.logits"] - t(x).logits).abs().max() <= ATOL, case
        assert torch.equal(outputs[f"{case}.tokens"], greedy(t, x[:1, :4])), case


# ----- options under recurrent mixers ------------------------------------------------------------------------
RECURRENT = {"mixer": "linear", "feature_map": "hedgehog", "chunk_size": 4}


@pytest.mark.parametrize("case", ["gemma3", "olmo2", "granite", "phi3", "smollm3-nope"])
@pytest.mark.parametrize("spec", [RECURRENT, {"mixer": "gdn", "chunk_size": 4}], ids=["linear", "gdn"])
def test_options_work_with_recurrent_mixers_through_the_cache(case: str, spec: dict) -> None:
    """Every layer recurrent: the whole-sequence forward equals a prefill then token-by-token decoding."""
    student = from_teacher(teacher(case), spec)
    x = ids(batch=1, length=12)
    with torch.no_grad():
        full = student(x).logits
        cache = student.new_cache()
        steps = [student(x[:, :5], past_key_values=cache, use_cache=True).logits]
        for i in range(5, 12):
            steps.append(student(x[:, i : i + 1], past_key_values=cache, use_cache=True).logits)
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-4, case


def test_prompt_in_blocks_keeps_each_layers_rotary() -> None:
    """A long prompt run into a cache block by block slices every rope group's cos / sin (Gemma 3)."""
    student = from_teacher(teacher("gemma3"), "softmax")
    x = ids(batch=1, length=13)
    with torch.no_grad():
        whole = student(x).logits
        student.config.prefill_block_size = 4
        blocks = student(x, past_key_values=student.new_cache(), use_cache=True).logits
    assert (blocks - whole).abs().max() <= ATOL


def test_qk_norm_and_scale_reach_every_mixer() -> None:
    """A recurrent layer sees the teacher's q and k (normed, rotated, scaled), exactly as the softmax layer does."""
    t = teacher("gemma3")
    hidden = torch.randn(1, 6, 32)
    positions = torch.arange(6)[None]
    projected = []
    for model in (from_teacher(t, "softmax"), from_teacher(t, RECURRENT)):
        rope = model.model.rotary_emb(hidden, position_ids=positions)
        projected.append(model.model.layers[1].self_attn.project(hidden, rope))
    (q, k, v), (q2, k2, v2) = projected
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
    attn = t.model.layers[1].self_attn
    raw = attn.q_proj(hidden).view(1, 6, 4, 16).transpose(1, 2)
    normed = attn.q_norm(raw)
    assert not torch.allclose(q[..., 0, :], raw[..., 0, :]) and not torch.allclose(normed, raw)
    # position 0 does not rotate: q there is the teacher's normed q times query_pre_attn_scalar ** -0.5 * sqrt(D)
    assert torch.allclose(q[..., 0, :], normed[..., 0, :] * 8**-0.5 * 16**0.5, atol=1e-6)


# ----- recipes choose the teacher layers ---------------------------------------------------------------------
def test_layers_select_which_teacher_layers_convert() -> None:
    t = teacher("gemma3")
    full_only = from_teacher(t, RECURRENT, layers={"convert": "full_attention"})
    assert [s["mixer"] for s in full_only.config.layer_specs()] == ["sliding_window", "linear"] * 2
    assert [s.get("window") for s in full_only.config.layer_specs()][::2] == [5, 5]
    indices = from_teacher(t, RECURRENT, layers={"convert": [0, -1]}).config.layer_specs()
    assert [s["mixer"] for s in indices] == ["linear", "softmax", "sliding_window", "linear"]
    kept = from_teacher(teacher("llama"), RECURRENT, layers={"keep_every": 2}).config.layer_specs()
    assert [s["mixer"] for s in kept] == ["linear", "softmax", "linear", "softmax"]
    # the layers that keep the teacher's attention compute exactly what the teacher's do
    x = ids(batch=1)
    with torch.no_grad():
        teacher_hidden = t(x, output_hidden_states=True).hidden_states[1]
        student_hidden = full_only(x, output_hidden_states=True).hidden_states[1]
    assert (teacher_hidden - student_hidden).abs().max() <= ATOL


def test_recipe_layers_field_validates_and_fingerprints() -> None:
    plain = recipe_from_dict(tiny_recipe_dict())
    same = recipe_from_dict({**tiny_recipe_dict(), "layers": None})
    chosen = recipe_from_dict({**tiny_recipe_dict(), "layers": {"convert": "full_attention"}})
    assert plain.fingerprint() == same.fingerprint() != chosen.fingerprint()
    assert "layers" not in json.dumps(plain.fingerprint())
    for bad, message in (
        ({"convert": "local"}, r"layers\.convert: a layer type is one of"),
        ({"keep_every": 1}, r"layers\.keep_every: an integer >= 2"),
        ({"convert": [1], "keep_every": 2}, r"layers: expected exactly one of"),
        ({"convert": []}, r"layers\.convert: a layer type or a non-empty list"),
    ):
        with pytest.raises(ValueError, match=message):
            recipe_from_dict({**tiny_recipe_dict(), "layers": bad}, source="r.yaml")


def test_recipe_naming_layers_the_teacher_lacks_is_one_error() -> None:
    llama = teacher("llama").config
    for layers, message in (
        ({"convert": [1, 7]}, r"r\.yaml: layers\.convert: the teacher has 4 layers \(0\.\.3\); no layer \[7\]"),
        ({"convert": "sliding_attention"}, r"r\.yaml: layers\.convert: the teacher has no sliding_attention layers "
                                           r"\(its layers: 4 full_attention\)"),
    ):
        recipe = recipe_from_dict({**tiny_recipe_dict(), "layers": layers}, source="r.yaml")
        with pytest.raises(ValueError, match=message):
            check_against_teacher(recipe, llama)


#: the student of each family's attention-KL run: a linear mixer with the denominator, or (Gemma 2 caps its softmax
#: logits, which only softmax-family mixers apply) softmax with a learned forget gate
KL_STUDENTS = {"gemma2": {"mixer": "softmax", "forget": "fox"}}


@pytest.mark.parametrize("case", list(FAMILIES))
def test_teacher_attention_weights_come_from_the_decoder_block(case: str) -> None:
    """stage1.attention_kl reads the teacher's attention weights off a softmax twin of each layer (the student's
    block with the teacher's spec, sharing its q/k weights): they are the teacher's own eager attention weights,
    with its q/k norms, scale, soft-cap, rotary groups, windows and NoPE layers."""
    t = teacher(case)
    t.config._attn_implementation = "eager"
    student = from_teacher(t, KL_STUDENTS.get(case, RECURRENT))
    x = ids()
    io = teacher_attention_io(t, x)
    pe = student.model.rotary_emb(io[0][0], position_ids=torch.arange(x.shape[1])[None])
    twins = softmax_twins(t, student.config, sorted(io))
    with torch.no_grad():
        want = t(x, output_attentions=True).attentions
        for i, (hidden, _) in sorted(io.items()):
            got = twins[i].log_attention_weights(hidden, pe).exp()
            assert (got - want[i]).abs().max() <= ATOL, (case, i)


@pytest.mark.parametrize("case", ["llama", "qwen3", "gemma2", "gemma3", "smollm3-nope", "granite"])
def test_stage1_with_attention_kl_runs_on_every_family(case: str) -> None:
    t = teacher(case)
    student = from_teacher(t, KL_STUDENTS.get(case, RECURRENT))
    settings = Stage1Settings(tokens=2 * 2 * 14, lr=1e-2, block_size=14, batch_size=2, attention_kl=1.0)
    result = attention_transfer(t, student, ids(batch=4), settings, progress=False)
    assert result.steps == 2 and sorted(result.attention_kl_last) == [0, 1, 2, 3]
    # finite and >= 0 (up to rounding: Gemma 2's fox student starts as the teacher, at KL 0)
    assert all(-1e-6 < kl < float("inf") for kl in result.attention_kl_last.values()), result.attention_kl_last
    recipe = recipe_from_dict(tiny_recipe_dict(KL_STUDENTS.get(case), stage1={"attention_kl": 0.1}), source="kl.yaml")
    check_against_teacher(recipe, teacher(case, max_position_embeddings=2048).config)  # no family is refused


def test_state_size_and_card_show_each_layer(tmp_path: Path) -> None:
    from hf_recattn.model_card import attention_table

    config = from_teacher(teacher("gemma3"), RECURRENT, layers={"convert": "full_attention"}).config
    rows = state_size_report(config, 1000)
    assert [r.label for r in rows] == ["sliding_window(5)", "linear"] * 2
    assert rows[0].state_elements == rows[2].state_elements == 4 * 2 * 2 * 16  # window - 1 keys and values
    text = format_report(rows)
    assert "sliding_window(5)" in text.splitlines()[1]
    table = attention_table(config)
    assert table.count("`sliding_window`") == 2 and 'window=5' in table and table.count("`linear`") == 2
    assert "| 0 | `sliding_window` | window=5 | 0.5 KiB |" in table  # 4 keys and values of 2 heads x 16, 2 bytes


def test_convert_end_to_end_with_recurrent_full_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``hf-recattn convert`` of a Qwen3 teacher with sliding layers: only its full-attention layers become
    recurrent, the window layers keep the teacher's weights and window."""
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))
    small = evaluation.RecallSizes(passkey_lengths=(256,), passkey_depths=(0.5,), passkey_trials=1,
                                   recall_lengths=(256,), recall_pairs=(1,), recall_trials=1,
                                   needle_tasks=("single_number",), needle_lengths=(1024,), needle_prompts=1,
                                   needle_haystacks=("heldout",))
    monkeypatch.setattr(evaluation.RecallSizes, "for_mode", classmethod(lambda cls, quick: small))
    tokenizer = tiny_tokenizer()
    t = teacher("qwen3", vocab_size=len(tokenizer), max_position_embeddings=2048, pad_token_id=2)
    t.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    recipe = tiny_recipe_dict(RECURRENT, layers={"convert": "full_attention"},
                              stage1={"tokens": 2 * 4 * 32, "projections": ["q_proj", "k_proj"]},
                              stage2={"tokens": 2 * 2 * 32})
    write_recipe(tmp_path / "qwen3-full.yaml", recipe)
    out = tmp_path / "run"
    args = ["convert", "--teacher", str(tmp_path / "teacher"), "--recipe", str(tmp_path / "qwen3-full.yaml"),
            "--output", str(out), "--corpus", str(tiny_corpus_file(tmp_path / "corpus.jsonl")), "--no-progress"]
    assert main(args) == 0
    model = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    assert [s["mixer"] for s in model.config.layer_specs()] == ["softmax", "linear"] * 2 or \
        [s["mixer"] for s in model.config.layer_specs()] == ["sliding_window", "linear"] * 2
    assert [s.get("window") for s in model.config.layer_specs()] == [5, None, 5, None]
    assert json.loads((out / "report.json").read_text())["recipe"]["layers"] == {"convert": "full_attention"}
    stage1 = json.loads((out / "stage1" / "result" / "summary.json").read_text())
    assert sorted(stage1["last_loss"]) == ["1", "3"]  # stage 1 trains the converted layers only
    generated = greedy(model, ids(batch=1, length=4), new=8)
    assert generated.shape[1] == 12


# ----- bad input ---------------------------------------------------------------------------------------------
def test_unsupported_family_and_unmapped_features_are_refused_before_any_work() -> None:
    moe = AutoConfig.for_model("qwen2_moe", **BASE)
    with pytest.raises(ValueError, match=r"teacher model_type 'qwen2_moe' is not a supported Llama-variant family"):
        recattn_config_from(moe, "softmax")
    odd_rope = AutoConfig.for_model("llama", **BASE, rope_parameters={**ROPE, "rope_type": "proportional"})
    with pytest.raises(ValueError, match=r"teacher family 'llama': .*rope_type 'proportional' has no mapping"):
        recattn_config_from(odd_rope, "softmax")
    both_ways = AutoConfig.for_model("gemma3_text", **BASE, head_dim=16, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match=r"teacher family 'gemma3_text': use_bidirectional_attention=True"):
        recattn_config_from(both_ways, "softmax")
    dropout = AutoConfig.for_model("phi3", **BASE, resid_pdrop=0.1)
    with pytest.raises(ValueError, match=r"'phi3': resid_pdrop=0.1 has no mapping \(dropout on the residual"):
        recattn_config_from(dropout, "softmax")
    chunked = AutoConfig.for_model("qwen3", **BASE)
    chunked.layer_types = ["chunked_attention"] * 4
    with pytest.raises(ValueError, match=r"'qwen3': layer_types \['chunked_attention'\] have no mapping"):
        recattn_config_from(chunked, "softmax")


def test_attention_soft_cap_is_refused_for_other_mixers() -> None:
    t = teacher("gemma2")
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=3.0: layer 0 \(linear\) has no attention logits"):
        from_teacher(t, RECURRENT)
    # kept softmax / window layers carry the cap; converting only those is refused the same way
    with pytest.raises(ValueError, match=r"layer 1 \(linear\)"):
        from_teacher(t, RECURRENT, layers={"convert": "full_attention"})
    assert from_teacher(t, {"mixer": "sliding_window", "window": 3}).config.attn_logit_softcapping == 3.0


@pytest.mark.parametrize(("option", "value", "message"), [
    ("norm_layout", "middle", r"norm_layout must be one of \['pre', 'post', 'sandwich'\], got 'middle'"),
    ("qk_norm", "l2", r"qk_norm must be one of \['head', 'projection'\] or None, got 'l2'"),
    ("residual_multiplier", 0.0, r"residual_multiplier must be a finite number > 0, got 0.0"),
    ("final_logit_softcapping", -1.0, r"final_logit_softcapping must be a finite number > 0 or None"),
    ("recompute_cache_after", 0, r"recompute_cache_after must be a positive int or None, got 0"),
    ("rope_layer_groups", ["local"], r"rope_layer_groups must list one group per layer \(2\)"),
    ("rope_layer_groups", ["local", "local"], r"rope_layer_groups names \['local'\] but rope_parameters has no"),
])
def test_bad_architecture_options_are_named(option: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RecAttnConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=VOCAB, **{option: value})


def test_whole_projection_qk_norm_refuses_tensor_parallelism() -> None:
    assert "qk_norm='projection'" in from_teacher(teacher("olmo2"), "softmax").tensor_parallel_refusal()
    assert from_teacher(teacher("qwen3"), "softmax").tensor_parallel_refusal() is None  # per head: splits by head


def test_defaults_are_llama() -> None:
    """A config without the new options builds the Llama block: the same weight names as before."""
    config = RecAttnConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           vocab_size=VOCAB)
    names = set(RecAttnForCausalLM(config).state_dict())
    assert {"model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"} <= names
    assert not any("q_norm" in n or "feedforward" in n for n in names)


def test_unit_offset_norms_start_as_identity_scales() -> None:
    """A fresh model with Gemma's norms stores their weights as offsets from 1: they start at 0."""
    config = RecAttnConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           vocab_size=VOCAB, norm_unit_offset=True, norm_layout="sandwich", qk_norm="head")
    norms = {n: p for n, p in RecAttnForCausalLM(config).named_parameters() if "norm" in n}
    assert len(norms) == 7 and all(bool((p == 0).all()) for p in norms.values())
