"""The learned retention score of the hybrid's exact cache (``cache_score: learned``): the retention head, its
decisions in every form against the float64 reference of test_hybrid_cache.py (fp32 within 1e-5 relative, float64
within 1e-10, gradients within 1e-9), with every kind of far part and with none, and its training target and loss.
"""

from __future__ import annotations

import math

import mixer_checks as checks
import pytest
import torch
from distill_fixtures import tiny_teacher, tiny_texts, tiny_tokenizer
from generation_cases import Case, tiny_model
from mixer_checks import PAD, SHAPE
from mixer_steps import left_padded
from reference import real_rows, rel_err
from reference_retention import answer_importance_reference, importance_reference, retention_score
from test_hybrid_cache import (  # noqa: F401 (toys: the toy far parts)
    FP32,
    FP64,
    GRAD,
    assert_cached_generation_equals_uncached,
    assert_float64_forms_match,
    make,
    reference_of,
    toys,
)

from hf_recattn import from_teacher
from hf_recattn.conversion.attention_transfer import attention_transfer, softmax_twins
from hf_recattn.conversion.settings import Stage1Settings
from hf_recattn.data.corpus import token_blocks
from hf_recattn.modeling.cache_scores import CACHE_SCORES, Decision, ScoreParts
from hf_recattn.modeling.mixer_base import MixerInputs
from hf_recattn.modeling.modeling import rotate_queries_and_keys
from hf_recattn.modeling.retention_head import RetentionHead
from hf_recattn.modeling.variants import variant_models
from hf_recattn.training.attention_objective import TransferObjective, teacher_attention_io
from hf_recattn.training.retention_objective import (
    answer_retention_targets,
    ranking_agreement,
    retention_loss,
    retention_targets,
)

HEAD_PARAMS = ("retention.b_in", "retention.b_out", "retention.w_in", "retention.w_out")


def perturbed_head(shape=SHAPE, seed: int = 0) -> RetentionHead:
    head = RetentionHead(shape)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return head


# ----- the head -----------------------------------------------------------------------------------------------
def test_the_head_matches_its_float64_reference() -> None:
    head = perturbed_head()
    gen = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(2, SHAPE.num_kv_heads, 5, SHAPE.head_dim, generator=gen) for _ in range(2))
    got = head(keys, values).detach()
    for b in range(2):
        for hk in range(SHAPE.num_kv_heads):
            for n in range(5):
                want = retention_score(head, hk, keys[b, hk, n], values[b, hk, n])
                assert math.isclose(float(got[b, hk, n]), want, rel_tol=1e-5, abs_tol=1e-5)


def test_a_pair_scores_the_same_at_any_position() -> None:
    """The rotary embedding turns pairs of key dimensions: the head reads only their norms, so the same key scores
    alike wherever it stands; a head reading the raw key would not."""
    head = perturbed_head()
    gen = torch.Generator().manual_seed(2)
    d = SHAPE.head_dim
    key = torch.randn(1, SHAPE.num_kv_heads, 1, d, generator=gen).expand(-1, -1, 6, -1)
    value = torch.randn(1, SHAPE.num_kv_heads, 1, d, generator=gen).expand(-1, -1, 6, -1)
    angles = torch.tensor([0.0, 1.0, 7.0, 100.0, 1000.0, 5000.0])[:, None] * torch.rand(d // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[None], torch.cat([angles.sin()] * 2, -1)[None]
    q = torch.zeros(1, SHAPE.num_heads, 6, d)
    _, rotated = rotate_queries_and_keys(q, key.contiguous(), cos, sin)
    assert not torch.allclose(rotated[:, :, 0], rotated[:, :, 3])
    scores = head(rotated, value)
    torch.testing.assert_close(scores, scores[..., :1].expand_as(scores), rtol=0, atol=1e-5)


def test_a_new_head_scores_every_pair_alike() -> None:
    """At initialization the output layer is zero: every pair 0, so the cache keeps the older pairs (ties)."""
    head = RetentionHead(SHAPE)
    keys = torch.randn(1, SHAPE.num_kv_heads, 7, SHAPE.head_dim)
    assert torch.equal(head(keys, torch.randn_like(keys)), torch.zeros(1, SHAPE.num_kv_heads, 7))


def test_the_score_reads_the_head_and_no_far_state() -> None:
    head = perturbed_head()
    keys = torch.randn(1, SHAPE.num_kv_heads, 4, SHAPE.head_dim)
    values = torch.randn_like(keys)
    decision = Decision(keys, values, {}, values[:, :, :2], torch.ones(1, 2, dtype=torch.bool),
                        torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool))
    learned = CACHE_SCORES["learned"]
    assert learned.learned and not learned.reads_far
    torch.testing.assert_close(learned.score(ScoreParts(None, head), decision), head(keys, values))


# ----- the forms against the reference ----------------------------------------------------------------------------
def make_learned(far: str, dtype: torch.dtype = torch.float32, **options) -> torch.nn.Module:
    mixer = make(far, dtype, cache_score="learned", **options)
    assert mixer.retention is not None
    with torch.no_grad():  # perturb_parameters already moved them; scale them up so that the ranking is spread
        for param in mixer.retention.parameters():
            param.mul_(4.0)
    return mixer


@pytest.mark.parametrize("sinks", [0, 1])
@pytest.mark.parametrize("far", ["linear-hedgehog", "toy", "delta", "none"])
def test_learned_forms_match_the_reference(far: str, sinks: int) -> None:
    """fp32: parallel, chunked, steps and a prefill + steps agree with the reference deciding by the head's scores;
    another score decides otherwise on the same inputs."""
    mixer = make_learned(far, sink_tokens=sinks)
    inputs = checks.random_inputs(SHAPE, 14, seed=11)
    mask = left_padded(14, PAD)
    with torch.no_grad():
        parallel, state = checks.assert_forms_agree(mixer, inputs, mask, FP32)
        expected = reference_of(mixer)(inputs, mask)
        by_novelty = make(far, cache_score="novelty", sink_tokens=sinks)
        by_novelty.load_state_dict(mixer.state_dict(), strict=False)
        other = by_novelty.parallel(*inputs[:3], MixerInputs(inputs[3], mask))
    assert rel_err(real_rows(parallel, mask), expected) < FP32
    assert state["cmask"].all()
    assert rel_err(real_rows(other, mask), expected) > 1e-4  # the head decides something here


@pytest.mark.parametrize("far", ["linear-elu", "delta", "none"])
def test_learned_float64_forms_match_the_reference_closely(far: str) -> None:
    assert_float64_forms_match(make_learned(far, torch.float64, window=2, slots=3, sink_tokens=1), seed=2)


@pytest.mark.parametrize("far", ["linear-hedgehog", "none"])
def test_learned_gradients_match_the_reference(far: str) -> None:
    """float64 gradients through the parallel form; the choice is discrete, so the head gets none from the output."""
    mixer = make_learned(far, torch.float64, window=2, slots=2, sink_tokens=1)
    unmixed = ("mix_logit",) if far == "none" else ()  # without a far part there is nothing to mix
    checks.assert_gradients_match(mixer, reference_of(mixer), 11, GRAD, unused=("x", *HEAD_PARAMS, *unmixed))


def test_a_cache_without_far_part_needs_a_score_that_reads_none() -> None:
    checks.assert_specs_rejected([({"mixer": "hybrid", "far": "none", "cache_slots": 2}, "layer 2",
                                   r"layer 2: option 'cache_slots' with cache_score='far' needs a far part")])
    mixer = make_learned("none")
    assert mixer.far is None and not any(name.startswith("far.") for name in mixer.init_state(1, "cpu",
                                                                                               torch.float32))


# ----- through the model ------------------------------------------------------------------------------------------
MODEL_SPECS = {
    "delta": {"mixer": "hybrid", "window": 2, "cache_slots": 2, "combine": "sum", "far": {"mixer": "delta"},
              "sink_tokens": 1, "cache_score": "learned"},
    "none": {"mixer": "hybrid", "window": 2, "cache_slots": 3, "far": "none", "sink_tokens": 1,
             "cache_score": "learned"},
}


def learned_model(name: str) -> torch.nn.Module:
    model = tiny_model(Case(name, MODEL_SPECS[name]))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if ".retention." in param_name:
                param.copy_(torch.randn(param.shape, generator=gen))
    return model


@pytest.mark.parametrize("name", list(MODEL_SPECS))
def test_learned_cached_generation_equals_uncached(name: str) -> None:
    """Greedy tokens with the cache equal the full forward's; logits within 1e-4 (left-padded rows, decisions every
    2 tokens in prefill and in decoding)."""
    assert_cached_generation_equals_uncached(learned_model(name))


def test_the_window_variant_leaves_the_head_out() -> None:
    variants = variant_models(learned_model("delta"))
    assert not any("retention" in name for name, _ in variants["window-only"].named_parameters())


# ----- the training target and loss -------------------------------------------------------------------------------
def test_targets_match_the_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 9, 9, generator=gen).masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), -torch.inf)
    log_weights = logits.log_softmax(-1)
    target, counted = retention_targets(log_weights, window=3, sink_tokens=1, groups=2)
    want, want_counted = importance_reference(log_weights.exp(), 3, 1, 2, 1e-6)
    assert torch.equal(counted, want_counted)
    torch.testing.assert_close(target[counted].double(), want[counted], rtol=1e-6, atol=1e-6)
    assert counted[..., 0].logical_not().all() and counted[..., -3:].logical_not().all()


def test_answer_targets_match_the_reference() -> None:
    """The ``answers`` target: answering queries' largest weight over later queries' mean weight, keys counted only
    before the first answering query less a window, none in a block without answers."""
    gen = torch.Generator().manual_seed(4)
    t = 12
    logits = torch.randn(3, 4, t, t, generator=gen).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
    log_weights = logits.log_softmax(-1)
    answers = torch.zeros(3, t, dtype=torch.bool)
    answers[0, 10:12] = True
    answers[1, [8, 11]] = True  # two questions: the first answer bounds the counted keys
    target, counted = answer_retention_targets(log_weights, answers, window=3, sink_tokens=1, groups=2)
    want, want_counted = answer_importance_reference(log_weights.exp(), answers, 3, 1, 2, 1e-6)
    assert torch.equal(counted, want_counted)
    assert counted[0].sum() == 2 * 6 and counted[1].sum() == 2 * 4 and not counted[2].any()
    torch.testing.assert_close(target[counted].double(), want[counted], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="answers"):
        answer_retention_targets(log_weights, answers[:, :5], window=3, sink_tokens=1, groups=2)


def test_the_loss_teaches_a_head_which_pairs_matter() -> None:
    """Keys whose values lie along one direction draw the teacher's later attention: a few hundred steps of the loss
    teach a fresh head to rank them first (a cache of their number filled as the teacher would), where it started
    at chance."""
    torch.manual_seed(0)
    shape, t = SHAPE, 48
    d = shape.head_dim
    keys, values = torch.randn(4, shape.num_kv_heads, t, d), torch.randn(4, shape.num_kv_heads, t, d)
    slots = 6  # important keys per row and KV head
    important = torch.rand(4, shape.num_kv_heads, t).argsort(-1).argsort(-1) < slots
    values = values + 3.0 * important[..., None] * torch.ones(d) / math.sqrt(d)
    target = torch.where(important, math.log(0.3), math.log(1e-4)) + 0.1 * torch.rand(4, shape.num_kv_heads, t)
    counted = torch.ones_like(important)
    head = RetentionHead(shape)
    before = ranking_agreement(head(keys, values).detach() + 1e-3 * torch.randn(4, shape.num_kv_heads, t), target,
                               counted, slots)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(300):
        optimizer.zero_grad()
        loss = retention_loss(head, keys, values, target, counted)
        loss.backward()
        optimizer.step()
    after = ranking_agreement(head(keys, values).detach(), target, counted, slots)
    assert after > 0.9 > before + 0.3


# ----- stage 1 of conversion ------------------------------------------------------------------------------------
def _agreement(teacher: torch.nn.Module, student: torch.nn.Module, blocks: torch.Tensor, slots: int) -> float:
    """How well each learned layer's head ranks the held-out blocks' keys as the teacher's attention does."""
    io = teacher_attention_io(teacher, blocks)
    pe = student.model.rotary_emb(io[0][0], position_ids=torch.arange(blocks.shape[1])[None])
    twins = softmax_twins(teacher, student.config, sorted(io))
    shares = []
    with torch.no_grad():
        for i, (hidden, _) in sorted(io.items()):
            attention = student.model.layers[i].self_attn
            _, keys, values = attention.project(hidden, pe)
            target, counted = retention_targets(twins[i].log_attention_weights(hidden, pe), attention.mixer.window,
                                                attention.mixer.sink_tokens, attention.mixer.shape.groups)
            shares.append(ranking_agreement(attention.mixer.retention(keys, values), target, counted, slots))
    return sum(shares) / len(shares)


def test_stage1_trains_the_head_on_the_teachers_attention() -> None:
    """Attention transfer of a learned-score student (no attention_kl) fetches the teacher's weights for the heads,
    reports their loss, and leaves them ranking held-out keys closer to the teacher's importance than at the start
    (where every key scores alike)."""
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    teacher = tiny_teacher(len(tokenizer))
    blocks = token_blocks(tokenizer, tiny_texts(), 32)
    spec = {"mixer": "hybrid", "window": 4, "sink_tokens": 1, "cache_slots": 4, "cache_score": "learned",
            "far": "none"}
    student = from_teacher(teacher, spec)
    before = _agreement(teacher, student, blocks[-4:], 4)
    settings = Stage1Settings(tokens=30 * 4 * 32, lr=2e-2, block_size=32, batch_size=4, save_every=10)
    result = attention_transfer(teacher, student, blocks[:-4], settings, progress=False)
    after = _agreement(teacher, student, blocks[-4:], 4)
    assert set(result.retention_last) == set(range(student.config.num_hidden_layers))
    assert after > before + 0.1, (before, after)


def test_the_answer_target_is_what_stage1_trains_on() -> None:
    """With ``retention_target: answers`` each layer's retention loss is the head's error against the answering
    queries' target of the batch's own answer tokens (another answer mask gives another loss); a batch without
    answer tokens is refused; attention transfer hands every block's answer tokens to the objective."""
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    teacher = tiny_teacher(len(tokenizer))
    blocks = token_blocks(tokenizer, tiny_texts(), 32)
    answers = torch.zeros(blocks.shape, dtype=torch.bool)
    answers[:, -4:] = True
    spec = {"mixer": "hybrid", "window": 4, "sink_tokens": 1, "cache_slots": 4, "cache_score": "learned",
            "far": "none"}
    student = from_teacher(teacher, spec)
    for head in student.modules():
        if isinstance(head, RetentionHead):
            torch.nn.init.normal_(head.w_out, std=1.0)  # a head that tells keys apart
    layers = list(range(student.config.num_hidden_layers))
    twins = softmax_twins(teacher, student.config, layers)
    objective = TransferObjective(teacher, student, layers, teacher_attention=twins, retention_target="answers")
    with torch.no_grad():
        objective(blocks[:2], answers[:2])
    io = teacher_attention_io(teacher, blocks[:2])
    pe = student.model.rotary_emb(io[0][0], position_ids=torch.arange(blocks.shape[1])[None])
    for i in layers:
        hidden = io[i][0]
        attention = student.model.layers[i].self_attn
        with torch.no_grad():
            _, keys, values = attention.project(hidden, pe)
            target, counted = answer_retention_targets(twins[i].log_attention_weights(hidden, pe), answers[:2], 4, 1,
                                                       attention.mixer.shape.groups)
            want = retention_loss(attention.mixer.retention, keys, values, target, counted)
        assert math.isclose(objective.values.retention[i], float(want), rel_tol=1e-5)
    moved = answers.roll(-6, dims=1)
    with torch.no_grad():
        objective(blocks[:2], moved[:2])
    assert all(not math.isclose(objective.values.retention[i], float(want), rel_tol=1e-3) for i in layers[-1:])
    with pytest.raises(ValueError, match="answer tokens"):
        objective(blocks[:2])
    settings = Stage1Settings(tokens=2 * 4 * 32, lr=2e-2, block_size=32, batch_size=4, save_every=10,
                              retrieval_share=0.5, retention_target="answers")
    result = attention_transfer(teacher, student, blocks, settings, progress=False, answers=answers)
    assert set(result.retention_last) == set(layers)
    with pytest.raises(ValueError, match="do not match"):
        attention_transfer(teacher, student, blocks, settings, progress=False, answers=answers[:, :5])


def test_the_answer_target_needs_retrieval_blocks() -> None:
    with pytest.raises(ValueError, match=r"stage1\.retention_target: answers needs stage1\.retrieval_share"):
        Stage1Settings(tokens=64, retention_target="answers").check("recipe.yaml")
    with pytest.raises(ValueError, match=r"stage1\.retention_target: 'max'"):
        Stage1Settings(tokens=64, retention_target="max").check("recipe.yaml")
