"""What the metric modules share: their ``evaluate.MetricInfo``, built from a description and the input columns."""

from __future__ import annotations

import datasets
import evaluate


def metric_info(description: str, inputs_description: str, **columns: str) -> evaluate.MetricInfo:
    """The info of one of the project's metrics; ``columns`` maps each input to its ``datasets.Value`` dtype."""
    return evaluate.MetricInfo(
        description=description,
        citation="",
        inputs_description=inputs_description,
        features=datasets.Features({name: datasets.Value(dtype) for name, dtype in columns.items()}),
    )
