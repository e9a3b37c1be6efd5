"""Passkey retrieval accuracy: the key's digits must appear in the model's answer (whitespace ignored)."""

from __future__ import annotations

import evaluate

from hf_recattn.evaluation.passkey import passkey_answered
from hf_recattn.metrics.common import metric_info

_DESCRIPTION = "Share of passkey answers that contain the key, per context length and on average over lengths."
_KWARGS = """
Args:
    predictions: the model's decoded answers.
    references: the hidden keys (digit strings).
    context_lengths: the prompt length of each trial, in tokens (its nominal length).
Returns:
    accuracy: {context length: share correct}.
    mean_accuracy: the mean over context lengths (each length weighs the same).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class PasskeyAccuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return metric_info(_DESCRIPTION, _KWARGS, predictions="string", references="string", context_lengths="int64")

    def _compute(self, predictions: list[str], references: list[str], context_lengths: list[int]) -> dict:
        hits: dict[str, list[bool]] = {}
        for answer, key, length in zip(predictions, references, context_lengths, strict=True):
            hits.setdefault(str(length), []).append(passkey_answered(answer, key))
        accuracy = {length: sum(h) / len(h) for length, h in sorted(hits.items(), key=lambda kv: int(kv[0]))}
        return {"accuracy": accuracy, "mean_accuracy": sum(accuracy.values()) / len(accuracy) if accuracy else None}
