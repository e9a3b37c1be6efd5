"""Associative recall accuracy: a query passes when its answer, whitespace removed, begins with the planted code."""

from __future__ import annotations

import evaluate

from hf_recattn.evaluation.recall import recall_answered
from hf_recattn.metrics.common import metric_info

_DESCRIPTION = ("Share of associative-recall queries answered with the planted code, per context length and number "
                "of planted pairs, and the mean over those cells.")
_KWARGS = """
Args:
    predictions: the model's decoded answer to each query.
    references: the code planted for the name asked (a digit string).
    context_lengths: the nominal context length of the query's prompt, in tokens.
    pairs: how many pairs were planted in that prompt.
Returns:
    accuracy: {context length: {pairs: share correct}}.
    mean_accuracy: the mean over the (length, pairs) cells (each cell weighs the same).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class AssociativeRecallAccuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return metric_info(_DESCRIPTION, _KWARGS, predictions="string", references="string", context_lengths="int64",
                           pairs="int64")

    def _compute(self, predictions: list[str], references: list[str], context_lengths: list[int],
                 pairs: list[int]) -> dict:
        hits: dict[int, dict[int, list[bool]]] = {}
        for answer, code, length, n in zip(predictions, references, context_lengths, pairs, strict=True):
            hits.setdefault(length, {}).setdefault(n, []).append(recall_answered(answer, code))
        accuracy = {str(length): {str(n): sum(h) / len(h) for n, h in sorted(cells.items())}
                    for length, cells in sorted(hits.items())}
        shares = [share for cells in accuracy.values() for share in cells.values()]
        return {"accuracy": accuracy, "mean_accuracy": sum(shares) / len(shares) if shares else None}
