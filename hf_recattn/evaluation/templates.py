"""The template files' loader and checks: this path keeps existing imports working; they live in
:mod:`hf_recattn.prompting.templates`, which the probes and the training data share."""

from __future__ import annotations

from ..prompting.templates import (
    KINDS,
    NEEDLE_FORMS,
    PARTS,
    SETTINGS,
    SPLITS,
    Template,
    TemplateError,
    TemplateSet,
    load_templates,
    probe_template,
    read_templates,
    templates,
    templates_folder,
    word_list,
)

__all__ = [
    "KINDS",
    "NEEDLE_FORMS",
    "PARTS",
    "SETTINGS",
    "SPLITS",
    "Template",
    "TemplateError",
    "TemplateSet",
    "load_templates",
    "probe_template",
    "read_templates",
    "templates",
    "templates_folder",
    "word_list",
]
