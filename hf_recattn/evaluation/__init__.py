"""Built-in evaluation of teachers and converted students, one module per job.

* ``heldout``: perplexity on held-out token blocks, and on long blocks of one document each;
* ``needles``: the recall probe in natural text (RULER's tasks on held-out and out-of-distribution documents, with
  Wilson intervals), the evidence of recall;
* ``passkey``, ``recall`` and ``distance``: the other recall probes (passkey retrieval in synthetic filler,
  multi-query associative recall, recall at fixed distances); each scores and runs prompts built by
  ``hf_recattn.prompting`` (the prompt builders the training data shares: the template files with their train /
  held-out split, the facts, the pieces and haystacks, one builder per probe), worded by the held-out templates,
  and runs them through ``generation`` (``greedy_continuation``: the one greedy decoding through the cache);
  ``templates``, ``facts`` and ``prompts`` keep the builders' older import paths;
* ``decode``: decode cost and cache size;
* ``suite``: all of them on one model (``evaluate``), and a sample through the cache (``cache_sample``);
* ``progress``: the progress bars of the long passes;
* ``store``: finished probes kept on disk, so that an interrupted evaluation resumes;
* ``report``: the comparison table and the report file.

Every function takes any causal LM (the softmax teacher or a hf_recattn student), so the numbers in a
conversion report are measured the same way on both. The names below are the public API.
"""

from __future__ import annotations

from ..prompting.pieces import fill_tokens, plant, sentence_pieces, token_pieces
from ..prompting.templates import Template, TemplateError, probe_template
from .decode import cache_nbytes, decode_stats
from .distance import DISTANCES, distance_prompt, distance_recall_probe
from .generation import (
    DEFAULT_PROMPTS,
    Continuation,
    generation_samples,
    greedy_continuation,
    max_positions,
    model_device,
    pad_id,
    prompt_ids,
)
from .heldout import LONG_LENGTHS, long_blocks, long_perplexity, perplexity
from .needles import (
    NEEDLE_HAYSTACKS,
    NEEDLE_LENGTHS,
    NEEDLE_PROMPTS,
    NEEDLE_TASKS,
    NeedlePrompt,
    natural_haystacks,
    needle_answered,
    needle_probe,
    needle_prompt,
    wilson_interval,
)
from .passkey import PASSKEY_DEPTHS, passkey_ids, passkey_probe, passkey_prompt
from .recall import associative_recall_probe
from .report import comparison_table, write_report
from .store import ProbeStore
from .suite import RecallSizes, cache_sample, describe_model, evaluate

__all__ = [
    "DEFAULT_PROMPTS",
    "DISTANCES",
    "LONG_LENGTHS",
    "NEEDLE_HAYSTACKS",
    "NEEDLE_LENGTHS",
    "NEEDLE_PROMPTS",
    "NEEDLE_TASKS",
    "PASSKEY_DEPTHS",
    "Continuation",
    "NeedlePrompt",
    "ProbeStore",
    "RecallSizes",
    "Template",
    "TemplateError",
    "associative_recall_probe",
    "cache_nbytes",
    "cache_sample",
    "comparison_table",
    "decode_stats",
    "describe_model",
    "distance_prompt",
    "distance_recall_probe",
    "evaluate",
    "fill_tokens",
    "generation_samples",
    "greedy_continuation",
    "long_blocks",
    "long_perplexity",
    "max_positions",
    "model_device",
    "natural_haystacks",
    "needle_answered",
    "needle_probe",
    "needle_prompt",
    "pad_id",
    "passkey_ids",
    "passkey_probe",
    "passkey_prompt",
    "perplexity",
    "plant",
    "probe_template",
    "prompt_ids",
    "sentence_pieces",
    "token_pieces",
    "wilson_interval",
    "write_report",
]
