"""The prompt builders the recall probes (``hf_recattn.evaluation``) and the training data
(``hf_recattn.conversion``) share, one module per job; nothing here imports either of them.

* ``templates``: the template files of ``hf_recattn/templates/retrieval`` (their loader and checks, the fixed
  split of held-out wording, which only the probes use, and training wording, which only training data uses);
* ``facts``: made-up names with values, in a template's words, tokenized where the answer begins and ends;
* ``pieces``: text cut at sentence starts, filler of an exact length, inserts planted at chosen depths;
* ``haystack``: documents laid end to end (``Haystack``), the documents of packed token blocks as texts;
* ``recall``: the associative-recall prompt (``recall_prompt``) and ``RecallPrompt``, the shape of every
  teacher-forced prompt;
* ``needles``: the needle prompts in natural text, the probe's (``needle_prompt``) and teacher-forced ones
  (``needle_training_prompt``);
* ``passkey``: the passkey prompt's ids; ``distance``: the prompt of recall at a fixed distance.
"""

from __future__ import annotations

from .distance import distance_prompt
from .facts import Fact, fact_ids, make_facts
from .haystack import Haystack, texts_from_blocks
from .needles import NEEDLE_TASKS, NeedlePrompt, needle_prompt, needle_training_prompt
from .passkey import passkey_ids, passkey_prompt, passkey_question_ids
from .pieces import fill_tokens, plant, sentence_pieces, token_pieces
from .recall import RecallPrompt, recall_prompt
from .templates import Template, TemplateError, probe_template, templates, word_list

__all__ = [
    "NEEDLE_TASKS",
    "Fact",
    "Haystack",
    "NeedlePrompt",
    "RecallPrompt",
    "Template",
    "TemplateError",
    "distance_prompt",
    "fact_ids",
    "fill_tokens",
    "make_facts",
    "needle_prompt",
    "needle_training_prompt",
    "passkey_ids",
    "passkey_prompt",
    "passkey_question_ids",
    "plant",
    "probe_template",
    "recall_prompt",
    "sentence_pieces",
    "templates",
    "texts_from_blocks",
    "token_pieces",
    "word_list",
]
