"""Facts for the recall prompts: this path keeps existing imports working; they live in
:mod:`hf_recattn.prompting.facts`, which the probes and the training data share."""

from __future__ import annotations

from ..prompting.facts import Fact, fact_ids, fact_values, made_up_name, make_facts, template_fact

__all__ = ["Fact", "fact_ids", "fact_values", "made_up_name", "make_facts", "template_fact"]
