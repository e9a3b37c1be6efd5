"""The project's metrics as local ``evaluate`` modules: ``evaluate.load(hf_recattn.metrics.path(NAME))``.

* ``heldout_perplexity``: exp(total negative log-likelihood / predicted tokens), token-weighted over blocks;
* ``passkey_accuracy``: a passkey answer is correct when the key's digits appear in it (whitespace ignored),
  with the accuracy per context length and their mean;
* ``associative_recall_accuracy``: a query is answered when its answer, whitespace removed, begins with the
  planted code (the probe's greedy verdict), with the accuracy per context length and number of pairs and the
  mean over those cells.

They compute exactly what ``hf_recattn.evaluation.perplexity``, ``passkey_probe`` and
``associative_recall_probe(scoring="greedy")`` report (the two accuracies take their verdicts from the probes'
modules), so that results written into a model card's ``model-index`` can be recomputed with the standard
``evaluate`` interface. Each module imports ``hf_recattn`` (installed, since the path comes from it); what they
share is in ``common``.
"""

from __future__ import annotations

from pathlib import Path

NAMES = ("heldout_perplexity", "passkey_accuracy", "associative_recall_accuracy")


def path(name: str) -> str:
    """The folder of a metric module, for ``evaluate.load``."""
    if name not in NAMES:
        raise ValueError(f"unknown metric {name!r}; known: {list(NAMES)}")
    return str(Path(__file__).parent / name)
