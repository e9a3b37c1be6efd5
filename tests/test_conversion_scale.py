"""The scale arithmetic of benchmarks/conversion_scale.py: parameter counts, the terms, what fits one GPU."""

from __future__ import annotations

from script_modules import load_script

scale = load_script("benchmarks", "conversion_scale")


def test_parameter_counts_match_transformers_models() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    assert scale.parameters(scale.ARCHS["Llama-3.1-8B"])["all"] == 8_030_261_248  # as published
    shape = (3, 64, 96, 4, 2, 16, 100)
    for tied in (True, False):
        values = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=100, tie_word_embeddings=tied)
        llama = LlamaForCausalLM(LlamaConfig(**values))
        assert scale.parameters((*shape, tied))["all"] == sum(p.numel() for p in llama.parameters())
        qwen3 = Qwen3ForCausalLM(Qwen3Config(**values))  # plus its per-head q / k norms, left out
        assert scale.parameters((*shape, tied))["all"] + 3 * 2 * 16 == sum(p.numel() for p in qwen3.parameters())


def test_terms_scale_with_the_block_and_the_vocabulary() -> None:
    shape = scale.ARCHS["Qwen3-1.7B"]
    one, two = scale.estimate(shape, scale.Run(1024)), scale.estimate(shape, scale.Run(2048))
    for key in ("captured", "one_layer", "activations", "final_hidden", "loss"):
        assert two[key] == 2 * one[key]
    assert one["loss"] == 10 * 151936 * 4 * 1024 and one["stage1_trainable"] == 28 * 2048 * 24 * 128
    assert one["lora_parameters"] == 28 * 8 * (4 * 2048 + 2 * 16 * 128 + 2 * 8 * 128)
    chunked = scale.estimate(shape, scale.Run(2048, loss_chunk=256, checkpointing=True))
    assert chunked["loss"] == 10 * 151936 * 4 * 256  # one chunk's logits, whatever the block
    assert chunked["activations"] == (28 * 2048 + 6 * 2048 + 2 * 16 * 128 + 2 * 8 * 128 + 4 * 6144) * 2 * 2048


def test_stage1_runs_the_teacher_up_to_the_last_converted_layer() -> None:
    shape = scale.ARCHS["Qwen3-0.6B"]
    every, first_four = scale.estimate(shape, scale.Run(2048)), scale.estimate(shape, scale.Run(2048, stage1_layers=4))
    assert every["captured"] == 7 * first_four["captured"] == 28 * 2 * 1024 * 2 * 2048


def test_qwen3_8b_stage2_with_lora_fits_40_gb_at_block_2048() -> None:
    """The documented row: both models in bf16, LoRA r=8, loss_chunk_size 256 and gradient checkpointing."""
    e = scale.gpu_estimate("Qwen3-8B", 2048, loss_chunk=256, checkpointing=True)
    assert e["parameters"] == 8_190_726_144  # without the q / k norms
    assert (e["teacher_weights"], e["student_weights"]) == (16_381_452_288, 16_381_452_288)
    assert e["lora_optimizer"] == 16 * 8 * 36 * (4 * 4096 + 2 * 32 * 128 + 2 * 8 * 128) == 122_683_392
    assert e["activations"] == (36 * 4096 + 83_968) * 2 * 2048 == 947_912_704
    assert e["final_hidden"] == 4096 * 4 * 2048 and e["loss"] == 10 * 151936 * 4 * 256 == 1_555_824_640
    total = e["stage2_state"] + e["stage2_local"]
    assert e["form_timing"] == 6 * 32 * 2048 * 2048 * 4  # the parallel form timed once, before training
    assert total == 36_106_813_440 < 40 * scale.GB
    plain = scale.gpu_estimate("Qwen3-8B", 2048)  # the defaults: every layer's activations, the block's logits
    assert plain["stage2_state"] + plain["stage2_local"] > 55 * scale.GB


def test_what_fits_one_gpu_and_how_many_gpus_sharding_needs() -> None:
    small, big = scale.gpu_estimate("Qwen3-0.6B", 2048), scale.gpu_estimate("Qwen3-8B", 2048)
    assert scale._fits(small, "full").endswith("(fits)") and scale._fits(big, "stage2").endswith("(fits)")
    state, local = big["full_state"], big["full_local"]
    assert state + local > scale.GPU_BYTES  # 16 bytes of Adam per parameter: 131 GB for 8B
    gpus = int(scale._fits(big, "full").split(">= ")[1].split()[0])
    assert state / gpus + local <= scale.GPU_BYTES < state / (gpus - 1) + local


def test_both_stages_train_a_bf16_student_where_the_models_are() -> None:
    """``--device`` mode's path on the CPU: a bf16 random Qwen3, blocks longer than the delta rule's chunk (so the
    faster form is timed on bf16 inputs and stage 1 feeds the chunked form's output to a bf16 o_proj)."""
    shape = (2, 64, 96, 4, 2, 16, 100, True)
    recipe = scale.scale_recipe("gdn", 2, 128, 48)  # loss chunks that do not divide the block
    for stage in scale.STAGES:
        m = scale.measure_device("tiny-qwen3", shape, stage, recipe, 2, "cpu", "auto")
        assert (m["stage"], m["dtype"], m["block_size"], m["tokens_per_step"]) == (stage, "bfloat16", 128, 128)
        assert (m["loss_chunk_size"], m["gradient_checkpointing"]) == (48, True)
        assert m["loss_kernel"] == (None if stage == "stage1" else "torch")  # auto: Liger on CUDA only
        assert len(m["step_seconds"]) == 1 and m["step_seconds"][0] > 0 and m["trainable_parameters"] > 0
        assert m["teacher_parameters"] == scale.parameters(shape)["all"] + 2 * 2 * 16  # + the q / k norms
        assert m["peak_bytes"] is None  # memory is measured on a GPU only


def test_the_gpu_results_render_beside_the_formulas() -> None:
    import json
    from pathlib import Path

    results = json.loads((Path(scale.__file__).parent / "results" / "conversion_scale_cuda.json").read_text())
    assert results["benchmark"] == "conversion_scale" and results["device"] == "cuda"
    lines = scale.render_markdown(results).splitlines()
    assert lines[0].startswith("| teacher (random init, bf16) |")
    rows = [line.split(" | ") for line in lines[2:2 + len(results["measured"])]]
    for m, row in zip(results["measured"], rows, strict=True):
        assert tuple(m["shape"]) == scale.ARCHS[m["size"]]
        assert float(row[7]) == round(scale.gpu_prediction(m) / scale.GB, 2)  # the formulas at the run's settings
        if m["stage"] == "stage2":  # measured with what the computed table's "scale" column assumes
            assert m["gradient_checkpointing"] and m["loss_chunk_size"] and m["loss_kernel"] in ("liger", "torch")
            e = scale.gpu_estimate(m["size"], m["block_size"], loss_chunk=m["loss_chunk_size"], checkpointing=True)
            assert scale.gpu_prediction(m) == e["stage2_state"] + e["stage2_local"]
        assert float(row[8].rstrip(" |")) == round(m["peak_bytes"] / scale.gpu_prediction(m), 2)
        assert m["loaded_bytes"] <= m["peak_bytes"]


def test_stage1_student_attention_keeps_a_bf16_layer_in_bf16() -> None:
    """The chunked delta rule computes in fp32; stage 1 casts its output back before the layer's bf16 o_proj."""
    import torch

    from hf_recattn.conversion.from_teacher import from_teacher
    from hf_recattn.conversion.recipe import load_recipe

    recipe = load_recipe("gdn", "quick")
    teacher = scale.qwen3_teacher((2, 64, 96, 4, 2, 16, 100, True), "cpu")
    student = from_teacher(teacher, recipe.attention, recipe.attention_overrides)
    hidden = torch.randn(1, 128, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rotary = student.model.rotary_emb(hidden, position_ids=torch.arange(128)[None])
    out, _ = student.model.layers[0].self_attn.attend(hidden, rotary)
    assert out.dtype == torch.bfloat16 and out.shape == hidden.shape and torch.isfinite(out).all()


def test_the_student_converts_only_the_layers_the_recipe_selects() -> None:
    """The recipe's ``layers`` as ``hf-recattn convert`` applies them: the other layers keep softmax, and stage 1
    trains (and runs the teacher up to) the converted ones only."""
    from hf_recattn.conversion.recipe import recipe_from_dict

    data = scale.scale_recipe("gdn", 1, 128, 64)
    data["layers"] = {"convert": [0]}
    recipe = recipe_from_dict(data, "scale")
    teacher = scale.qwen3_teacher((2, 64, 96, 4, 2, 16, 100, True), "cpu")
    student = scale.build_student(teacher, recipe)
    assert [layer.self_attn.mixer.name for layer in student.model.layers] == ["delta", "softmax"]
    trained, layers = scale.stage1_trained(student, recipe, teacher.config)
    assert layers == 1 and trained == sum(p.numel() for p in scale.mixer_parameters(student, ("q_proj", "k_proj"))[0]
                                          .values())
    m = scale.measure_device("tiny-qwen3", (2, 64, 96, 4, 2, 16, 100, True), "stage1", data, 2, "cpu", "auto")
    assert m["trainable_parameters"] == m["stage1_trainable"] == trained and m["stage1_layers"] == 1


def test_a_measured_shape_row_is_set_beside_its_formulas() -> None:
    """A Qwen3-shaped CPU row: bf16 teacher, fp32 student (12 optimizer bytes per trained parameter)."""
    shape = scale.SHAPES["Qwen3-0.6B"]
    row = {"size": "Qwen3-0.6B", "stage": "stage2", "shape": list(shape), "block_size": 2048, "stage1_layers": 28,
           "stage1_trainable": 100, "lora_r": 8, "loss_chunk_size": 256, "gradient_checkpointing": True}
    e = scale.estimate(shape, scale.Run(2048, 2, 4, 12, 28, 100, 8, 256, True))
    training = e["activations"] + e["final_hidden"] + e["loss"]
    assert scale.shape_prediction(row) == 6 * e["parameters"] + e["lora_optimizer"] + max(training, e["form_timing"])
    stage1 = max(e["captured"] + e["one_layer"], e["form_timing"])
    assert scale.shape_prediction({**row, "stage": "stage1"}) == 6 * e["parameters"] + 12 * 100 + stage1


def test_the_quick_mode_runs(tmp_path) -> None:
    out = tmp_path / "quick.json"
    assert scale.main(["--quick", "--out", str(out)]) == 0
    import json

    results = json.loads(out.read_text())
    assert [(m["size"], m["stage"]) for m in results["measured"]] == [("tiny", "stage1"), ("tiny", "stage2")]
    table = scale.render_markdown(results)
    assert all(f"| {name} |" in table for name in scale.ARCHS)  # the computed rows


def test_the_shapes_table_shows_each_heap_and_the_steps_it_timed() -> None:
    """A CPU row says which mmap threshold its process ran with; a row without a timed step shows "-"; the notes
    count the steps of each shape from its rows."""
    shape = scale.SHAPES["SmolLM2-135M"]
    row = {"size": "SmolLM2-135M", "stage": "stage1", "shape": list(shape), "block_size": 2048, "stage1_layers": 30,
           "stage1_trainable": 100, "lora_r": 8, "loss_chunk_size": 256, "gradient_checkpointing": True,
           "teacher_parameters": 134_515_008, "baseline_rss": 500 * scale.MIB, "loaded_rss": 1300 * scale.MIB,
           "peak_rss": 2300 * scale.MIB, "step_seconds": [20.0, 22.0], "stage_system_seconds": 6.0,
           "malloc_mmap_threshold": scale.MIB}
    one = {**row, "size": "Qwen3-1.7B", "step_seconds": [], "malloc_mmap_threshold": None}
    data = {"mode": "shapes", "recipe": "gdn", "block_size": 2048, "loss_chunk_size": 256, "threads": 1,
            "measured": [row, one], "convert": []}
    lines = scale.render_markdown({**data, "notes": scale._shapes_notes(data)}).splitlines()
    assert lines[2].startswith("| SmolLM2-135M | 0.135B | mmap from 1 MiB | stage1 | 21 | 2.0 | 500 | 1300 | 2300 |")
    assert lines[3].startswith("| Qwen3-1.7B | 0.135B | glibc default | stage1 | - | 6.0 |")
    assert "optimizer steps per stage: SmolLM2-135M 3, Qwen3-1.7B 1" in lines[5]


def test_a_bad_heap_threshold_is_refused_before_any_run(capsys) -> None:  # noqa: ANN001
    import pytest

    with pytest.raises(SystemExit):
        scale.parse_args(["--shapes", "SmolLM2-135M", "--malloc-mmap-threshold", "-1"])
    assert "--malloc-mmap-threshold must be between 0" in capsys.readouterr().err


def test_checkpointing_keeps_the_chunked_delta_rules_inputs_in_the_formula() -> None:
    """Each gdn layer's own checkpoint (the chunked delta rule's groups of chunks) holds q and k after the Hedgehog
    map (2d wide) and v: counted per token beside the layer inputs, where the block is longer than the chunk."""
    from hf_recattn.conversion.recipe import recipe_from_dict

    recipe = recipe_from_dict(scale.scale_recipe("gdn", 1, 128, 64), "scale")
    shape = (2, 64, 96, 4, 2, 16, 100, True)
    student = scale.build_student(scale.qwen3_teacher(shape, "cpu"), recipe)
    assert scale.checkpoint_kept(student, 128) == 2 * (4 * 32 + 2 * (32 + 16))
    assert scale.checkpoint_kept(student, student.model.layers[0].self_attn.mixer.chunk_size) == 0
    kept = scale.Run(128, checkpointing=True, checkpoint_kept=1000)
    plain = scale.estimate(shape, scale.Run(128, checkpointing=True))
    assert scale.estimate(shape, kept)["activations"] - plain["activations"] == 1000 * 2 * 128


def test_a_whole_convert_with_unset_memory_options_says_what_stage_2_chose() -> None:
    """``--unset-memory-options``: the scale budget leaves both options as the recipe has them (unset, so that stage
    2 chooses them); the whole-convert table says which options each run had, its steps and a left-out evaluation."""
    from hf_recattn.conversion.recipe import recipe_from_dict

    unset = recipe_from_dict(scale.scale_recipe("gdn", 1, 2048, None), "scale").stage2
    assert (unset.loss_chunk_size, unset.gradient_checkpointing, unset.tokens) == (None, None, 2048)
    set_ = recipe_from_dict(scale.scale_recipe("gdn", 2, 2048, 256), "scale").stage2
    assert (set_.loss_chunk_size, set_.gradient_checkpointing, set_.tokens) == (256, True, 4096)
    peaks = {stage: 1000 * scale.MIB for stage in scale.PIPELINE_STAGES}
    old = {"size": "Qwen3-0.6B", "malloc_mmap_threshold": 2 * scale.MIB, "stage_peak_rss": peaks,
           "peak_rss": 7000 * scale.MIB, "seconds": 1620.0}
    chosen = {**old, "memory_options": "unset", "steps": 1, "evaluated": False, "seconds": 600.0,
              "stage2_memory": {"loss_chunk_size": 256, "gradient_checkpointing": True}}
    data = {"mode": "shapes", "recipe": "gdn", "block_size": 2048, "loss_chunk_size": 256, "threads": 1,
            "measured": [], "convert": [old, chosen], "notes": []}
    lines = scale.render_markdown(data).splitlines()
    assert "| Qwen3-0.6B | mmap from 2 MiB | set: loss_chunk_size 256, checkpointing | 2 | 1000 |" in lines[5]
    assert lines[6].startswith("| Qwen3-0.6B | mmap from 2 MiB | unset, chosen: loss_chunk_size 256, checkpointing "
                               "| 1 | 1000 | 1000 | 1000 | 1000 | - (--no-eval) | 7000 | 10 |")
