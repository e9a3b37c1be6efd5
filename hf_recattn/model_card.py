"""Model cards for hf_recattn checkpoints, rendered from ``model_cards/templates/model_card.md``.

The front matter follows the Hub's conventions (``huggingface_hub.ModelCardData``): ``library_name``,
``pipeline_tag``, ``base_model`` (the teacher), ``license`` (the teacher's), tags, and a ``model-index`` with the
held-out perplexity, recall of facts hidden in natural text (needles), the synthetic passkey and associative recall
accuracy of a conversion report. The body is built
from the checkpoint's config (attention per layer, state size against the teacher's KV cache) and, when there is
one, its ``report.json``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .atomic import write_text
from .conversion.baselines import WINDOW_LABEL
from .conversion.recipe import is_packaged_source
from .embedded_teachers import TEACHERS
from .evaluation import comparison_table
from .evaluation.needles import NEEDLE_HAYSTACK_NAMES
from .evaluation.report import needle_means, ood_perplexity
from .modeling.cache_precision import PAIR_CODES, pair_codes
from .modeling.cache_scores import CACHE_SCORES
from .modeling.configuration import RecAttnConfig, read_checkpoint_config
from .modeling.hybrid_options import hybrid_cache_choices, hybrid_cache_dtypes, hybrid_cache_slots
from .state_size import exact_cache_bytes, state_bytes, state_size_report, teacher_kv_bytes

TEMPLATE = Path(__file__).parent / "templates" / "model_card.md"
STATE_CONTEXTS = (1024, 8192, 32768)
BYTES_PER_ELEMENT = 2
_HUB_MODEL_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
#: licenses of teachers we know without reading their cards, and the notices their terms ask derivatives to carry
KNOWN_LICENSES = {t.model_id: t.license for t in TEACHERS.values()}
LICENSE_NOTICES = {t.model_id: t.notice for t in TEACHERS.values()}

_GENERATE = """messages = [{"role": "user", "content": "What is the capital of France?"}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**inputs, max_new_tokens=40)  # decodes through the recurrent cache
print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))"""
_GENERATE_PLAIN = """inputs = tokenizer("The capital of France is", return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=40)  # decodes through the recurrent cache
print(tokenizer.decode(out[0], skip_special_tokens=True))"""


def compact_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The options of a validated spec that differ from its family's defaults (nested specs too)."""
    from .modeling.mixers import validate_spec

    defaults = validate_spec({"mixer": spec["mixer"]}, "model card")
    out: dict[str, Any] = {}
    for key, value in spec.items():
        if key == "mixer" or defaults.get(key) == value:
            continue
        out[key] = {"mixer": value["mixer"], **compact_spec(value)} if isinstance(value, dict) else value
    return out


def _spec_text(spec: dict[str, Any]) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in compact_spec(spec).items())


def human_bytes(n: float) -> str:
    """MiB with two decimals from 1 MiB up, KiB below."""
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def attention_table(config: RecAttnConfig, context: int = STATE_CONTEXTS[-1]) -> str:
    """One row per run of consecutive layers with the same spec, with each such layer's decode state at
    ``context`` tokens (a KV cache grows with the context; a window or a recurrent state stops growing)."""
    state = [row.state_bytes(BYTES_PER_ELEMENT) for row in state_size_report(config, context)]
    runs: list[tuple[int, int, dict[str, Any]]] = []
    for i, spec in enumerate(config.layer_specs()):
        if runs and runs[-1][2] == spec:
            runs[-1] = (runs[-1][0], i, spec)
        else:
            runs.append((i, i, spec))
    lines = [f"| layers | mixer | options (beyond the family's defaults) | state per layer at {context:,} tokens |",
             "|---|---|---|---:|"]
    for first, last, spec in runs:
        layers = str(first) if first == last else f"{first}-{last}"
        lines.append(f"| {layers} | `{spec['mixer']}` | {_spec_text(spec) or '-'} | {human_bytes(state[first])} |")
    return "\n".join(lines)


def state_table(config: RecAttnConfig, contexts: Sequence[int] = STATE_CONTEXTS) -> str:
    """Decode state against the teacher's KV cache (a layer the teacher slid at its window), per context length."""
    lines = ["| context | this model | teacher's KV cache | ratio |", "|---:|---:|---:|---:|"]
    for context in contexts:
        rows = state_size_report(config, context)
        state = state_bytes(rows, BYTES_PER_ELEMENT)
        kv = teacher_kv_bytes(rows, BYTES_PER_ELEMENT)
        lines.append(f"| {context:,} | {human_bytes(state)} | {human_bytes(kv)} | {state / kv:.4f} |")
    slots = hybrid_cache_slots(config)
    if slots:
        cache = exact_cache_bytes(config, contexts[-1], BYTES_PER_ELEMENT)
        keeps = "; ".join(CACHE_SCORES[score].keeps + (f", the {reserve:,} newest kept first" if reserve else "")
                          for score, reserve in hybrid_cache_choices(config))
        coded = [pair_codes(d).description for d in hybrid_cache_dtypes(config) if d in PAIR_CODES]
        held = f", its slots holding {' or '.join(coded)}" if coded else ""
        lines += ["", f"Of this model's state, the exact cache of its hybrid layers (`cache_slots` {slots}: {keeps}, "
                  f"and the buffer of those waiting to be ranked) takes {human_bytes(cache)} at every context{held}."]
    return "\n".join(lines)


def _eval_results(report: dict[str, Any], model_name: str) -> list[Any]:
    from huggingface_hub import EvalResult

    student = report.get("student") or {}
    dataset = dict(dataset_type="hf_recattn/heldout", dataset_name=_corpus_name(report), dataset_split="heldout")
    results = []
    if student.get("perplexity") is not None:
        results.append(EvalResult(task_type="text-generation", metric_type="perplexity",
                                  metric_name="held-out perplexity", metric_value=round(student["perplexity"], 4),
                                  **dataset))
    teacher = (report.get("comparison") or {}).get("teacher") or {}
    if student.get("perplexity") and teacher.get("perplexity"):
        results.append(EvalResult(task_type="text-generation", metric_type="perplexity_ratio",
                                  metric_name="perplexity / teacher's",
                                  metric_value=round(student["perplexity"] / teacher["perplexity"], 4), **dataset))
    needles = student.get("needles") or {}
    for haystack, accuracy in needle_means(student).items():
        results.append(EvalResult(task_type="text-generation", metric_type=f"needle_accuracy_{haystack}",
                                  metric_name=f"needle recall ({_needle_scope(needles)})",
                                  metric_value=round(accuracy, 4), dataset_type=f"hf_recattn/needles_{haystack}",
                                  dataset_name=f"facts hidden in {NEEDLE_HAYSTACK_NAMES.get(haystack, haystack)}"))
    passkey = (student.get("passkey") or {})
    if passkey.get("mean_accuracy") is not None:
        lengths = ", ".join(sorted(passkey.get("accuracy", {}), key=int))
        results.append(EvalResult(task_type="text-generation", metric_type="passkey_accuracy",
                                  metric_name=f"synthetic passkey accuracy ({lengths} tokens)",
                                  metric_value=round(passkey["mean_accuracy"], 4), dataset_type="hf_recattn/passkey",
                                  dataset_name="synthetic passkey retrieval (a key in repeated filler)"))
    recall = student.get("associative_recall") or {}
    if recall.get("mean_accuracy") is not None:
        lengths = ", ".join(sorted(recall.get("accuracy", {}), key=int))
        pairs = ", ".join(str(n) for n in recall.get("pairs", []))
        results.append(EvalResult(task_type="text-generation", metric_type="associative_recall_accuracy",
                                  metric_name=f"associative recall accuracy ({lengths} tokens; {pairs} pairs)",
                                  metric_value=round(recall["mean_accuracy"], 4),
                                  dataset_type="hf_recattn/associative_recall",
                                  dataset_name=f"associative recall in the {_corpus_name(report)}"))
    return results


def _needle_scope(needles: dict[str, Any]) -> str:
    """The needle probe's tasks and lengths, as a card names them: ``single_number, multi_key; 1024 tokens``."""
    lengths = ", ".join(str(n) for n in needles.get("lengths", []))
    return f"{', '.join(needles.get('tasks', []))}; {lengths} tokens"


def _needle_text(needles: dict[str, Any]) -> str:
    """This model's needle cells: accuracy and Wilson 95% interval per task, haystack and length."""
    cells = []
    for task, by_haystack in (needles.get("cells") or {}).items():
        for haystack, by_length in by_haystack.items():
            for length, cell in _by_length(by_length):
                low, high = cell["interval"]
                cells.append(f"{task} in {NEEDLE_HAYSTACK_NAMES.get(haystack, haystack)} at {length} tokens "
                             f"{cell['accuracy']:.0%} [{low:.0%}-{high:.0%}] of {cell['n']}")
    return ("Recall of facts stated once in natural text and asked at the end (greedy; wording and documents no "
            f"training block uses; 95% intervals): {'; '.join(cells)}.")


def _corpus_name(report: dict[str, Any]) -> str:
    data = (report.get("identity") or {}).get("data") or report.get("data") or "embedded"
    return "embedded corpus (Python documentation)" if data == "embedded" else str(data)


def _evaluation(report: dict[str, Any] | None) -> str:
    if not report or not report.get("comparison"):
        return "No evaluation report ships with this checkpoint."
    rows = report["comparison"]
    student = report.get("student") or {}
    passkey = student.get("passkey") or {}
    per_length = ", ".join(f"{k} tokens: {v:.0%}" for k, v in _by_length(passkey.get("accuracy", {})))
    recall = "associative_recall" in student
    parts = [
        f"Held-out perplexity on {student.get('eval_tokens', '?')} tokens of the {_corpus_name(report)} in blocks "
        f"of {student.get('block_size', '?')} (the same tokens for every row); recall of facts hidden in natural text "
        "(needles, the mean over the probe's tasks and lengths); the synthetic passkey (a key in repeated filler, "
        "which a cache can pass without recall); "
        + ("associative recall accuracy (codes of made-up people planted in held-out text, then asked); "
           if recall else "")
        + "greedy decode cost through the cache. For hybrids, window-only and far-only are this model with one "
        "part removed."
        + (f" {WINDOW_LABEL} is the teacher's own weights, untrained, with softmax over only the last 512 tokens and "
           "the first 4: the constant-memory cache this model is read against." if WINDOW_LABEL in rows else ""),
        comparison_table(rows),
    ]
    if (student.get("needles") or {}).get("cells"):
        parts.append(_needle_text(student["needles"]))
    if per_length:
        parts.append(f"Synthetic passkey accuracy of this model by context: {per_length}.")
    by_depth = "; ".join(f"{k} tokens: " + ", ".join(f"{d}: {v:.0%}" for d, v in depths.items())
                         for k, depths in _by_length(passkey.get("accuracy_by_depth", {})))
    if by_depth:
        parts.append(f"Synthetic passkey accuracy by depth of the key (0 = start of the context): {by_depth}.")
    if recall:
        parts.append(_recall_text(student["associative_recall"]))
    distance = ", ".join(f"{k} tokens back: {v:.0%}"
                         for k, v in _by_length((student.get("recall_by_distance") or {}).get("accuracy", {})))
    if distance:
        parts.append(f"Recall of one fact by how far before the question it was planted: {distance}.")
    return "\n\n".join(parts)


def _by_length(values: dict[str, Any]) -> list[tuple[str, Any]]:
    return sorted(values.items(), key=lambda kv: int(kv[0]))


def _recall_text(recall: dict[str, Any]) -> str:
    """The associative recall accuracy of this model per context length and number of planted pairs."""
    cells = "; ".join(f"{k} tokens: " + ", ".join(f"{n} pairs {v:.0%}" for n, v in per.items())
                      for k, per in _by_length(recall.get("accuracy", {})))
    queries = f"up to {recall['max_queries']} queries per prompt" if "max_queries" in recall else "queries"
    return (f"Associative recall accuracy of this model ({queries}, {recall.get('scoring', '?')} scoring): "
            f"{cells or 'no context length fitted the model'}.")


def _stage2_method(stage2: dict[str, Any]) -> str:
    return "every weight" if stage2.get("method") == "full" else "LoRA"


def _license_notice(teacher: str | None) -> str:
    notice = LICENSE_NOTICES.get(teacher or "")
    return f"\n\nLicense: a model derived from `{teacher}`, under its terms. {notice}" if notice else ""


def _provenance(report: dict[str, Any] | None, teacher: str | None) -> str:
    if not report:
        base = f"Made from `{teacher}`. " if teacher else ""
        return base + "No conversion report ships with this checkpoint (it was saved or pushed from Python)."
    recipe = report.get("recipe") or {}
    s1, s2 = recipe.get("stage1") or {}, recipe.get("stage2") or {}
    init = report.get("init")  # a run continued from another converted checkpoint
    lines = [
        f"Converted from `{report.get('teacher', teacher)}` by `hf-recattn convert` with recipe "
        f"`{recipe.get('name', '?')}` (budget `{recipe.get('budget', '?')}`, seed {recipe.get('seed', '?')}) on the "
        f"{_corpus_name(report)}:",
        f"- stage 1, attention transfer: {s1.get('tokens', 0):,} tokens (each layer's new attention learns to match "
        "the teacher's attention output);",
        f"- stage 2, finetuning with transformers' Trainer ({_stage2_method(s2)}, loss `{s2.get('loss', '?')}` "
        f"against the data and the teacher): {s2.get('tokens', 0):,} tokens" + (";" if init else "."),
    ]
    if init:
        lines.append(
            f"- continued from the converted checkpoint `{init['checkpoint']}` (recipe `{init.get('recipe')}`, "
            f"{init['training_tokens']:,} training tokens): {report['training_tokens']:,} training tokens in all."
        )
    if recipe.get("serve_overrides"):
        served = "; ".join(f"layers `{key}`: " + ", ".join(f"`{k}: {v}`" for k, v in options.items())
                           for key, options in recipe["serve_overrides"].items())
        lines.append(f"- then saved to serve with other options of its hybrid layers, the weights unchanged "
                     f"(`serve_overrides`): {served}.")
    if recipe.get("description"):
        lines += ["", str(recipe["description"]).strip()]
    import yaml

    shown = {k: v for k, v in recipe.items() if k != "source"}  # where the YAML lay on the converting machine
    recipe_yaml = yaml.safe_dump(shown, sort_keys=False, allow_unicode=True).rstrip()
    lines += ["", "<details><summary>The whole recipe</summary>", "", f"```yaml\n{recipe_yaml}\n```", "",
              "</details>"]
    return "\n".join(lines)


def _limitations(config: RecAttnConfig, report: dict[str, Any] | None) -> str:
    kinds = {row.kind for row in state_size_report(config, 1)}
    lines = []
    if "kv" in kinds:
        lines.append("- Some layers keep a KV cache, which grows with the context.")
    if kinds & {"recurrent", "window"}:
        lines.append("- Recurrent and window layers keep a fixed-size state: what falls out of a window or does "
                     "not fit in a state is forgotten, so exact recall of long contexts is weaker than the teacher's.")
    student = (report or {}).get("student") or {}
    teacher = ((report or {}).get("comparison") or {}).get("teacher") or {}
    if student.get("perplexity") and teacher.get("perplexity"):
        ratio = student["perplexity"] / teacher["perplexity"]
        student_ood, teacher_ood = ood_perplexity(student), ood_perplexity(teacher)
        other = (f" ({student_ood / teacher_ood:.2f}x on {NEEDLE_HAYSTACK_NAMES['ood']}, which no training block "
                 "uses)" if student_ood is not None and teacher_ood else "")
        lines.append(f"- Held-out perplexity is {ratio:.2f}x the teacher's{other}, measured on one corpus; other "
                     "text may fare differently.")
    needles = needle_means(student)
    passkey = (student.get("passkey") or {}).get("mean_accuracy")
    if needles and min(needles.values()) < 0.9:
        shares = " and ".join(f"{v:.0%} in {NEEDLE_HAYSTACK_NAMES.get(h, h)}" for h, v in needles.items())
        lines.append(f"- Facts hidden once in natural text are recalled {shares}: do not rely on this model to "
                     "retrieve one fact from a long prompt.")
    elif not needles and passkey is not None and passkey < 0.9:
        lines.append(f"- Passkey retrieval succeeds in {passkey:.0%} of trials: do not rely on this model to "
                     "retrieve one fact from a long prompt.")
    recall = (student.get("associative_recall") or {}).get("mean_accuracy")
    if recall is not None and recall < 0.9:
        lines.append(f"- Associative recall answers {recall:.0%} of queries: do not rely on this model to keep "
                     "several facts from a long prompt.")
    recipe = (report or {}).get("recipe") or {}
    # a recipe file's budgets are its own: only a packaged quick budget is the small one
    if recipe.get("budget") == "quick" and is_packaged_source(recipe.get("source")):
        lines.append("- This is a quick-budget conversion: few training tokens and small evaluation probes.")
    elif (recipe.get("eval") or {}).get("quick") or student.get("quick"):
        lines.append("- Its evaluation ran the quick probes: the recall figures above are small samples (see their "
                     "intervals).")
    lines.append("- Inherits the teacher's biases and limitations.")
    return "\n".join(lines)


def build_model_card(
    folder: str | Path,
    repo_id: str,
    report: dict[str, Any] | None = None,
    teacher: str | None = None,
    license: str | None = None,
) -> Any:
    """A ``huggingface_hub.ModelCard`` for the checkpoint in ``folder`` (its ``report.json`` is read if
    ``report`` is None). ``teacher`` / ``license`` override what the report says."""
    from huggingface_hub import ModelCard, ModelCardData

    folder = Path(folder)
    config = read_checkpoint_config(folder)
    if report is None and (folder / "report.json").is_file():
        report = json.loads((folder / "report.json").read_text())
    teacher = teacher or (report or {}).get("teacher")
    license = license or (report or {}).get("teacher_license") or KNOWN_LICENSES.get(teacher or "")
    mixers = sorted({spec["mixer"] for spec in config.layer_specs()})
    data = ModelCardData(
        model_name=repo_id,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        base_model=teacher if teacher and _HUB_MODEL_ID.match(teacher) else None,
        tags=["hf_recattn", "recurrent-attention", *(f"mixer-{m}" for m in mixers)]
        + (["distillation"] if report else []),
        eval_results=_eval_results(report, repo_id) if report and report.get("student") else None,
    )
    chat = (folder / "chat_template.jinja").is_file() or "chat_template" in _tokenizer_config(folder)
    summary = (
        f"A causal language model whose attention is recurrent where its mixers are ({', '.join(mixers)}): "
        "it generates with a fixed-size state per recurrent layer instead of a growing KV cache. Built with "
        "hf_recattn" + (f" from `{teacher}`." if teacher else ".")
    )
    return ModelCard.from_template(
        data,
        template_path=str(TEMPLATE),
        repo_id=repo_id,
        summary=summary,
        attention_table=attention_table(config),
        state_table=state_table(config),
        provenance=_provenance(report, teacher) + _license_notice(teacher),
        evaluation=_evaluation(report),
        generate_snippet=_GENERATE if chat else _GENERATE_PLAIN,
        limitations=_limitations(config, report),
    )


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def write_model_card(folder: str | Path, repo_id: str | None = None, **kwargs: Any) -> Path:
    """Render the card for ``folder`` and write it to ``folder/README.md`` (atomically); returns the path."""
    folder = Path(folder)
    card = build_model_card(folder, repo_id or folder.resolve().name, **kwargs)
    return write_text(folder / "README.md", str(card))
