"""Held-out perplexity from per-block summed negative log-likelihoods and predicted-token counts."""

from __future__ import annotations

import math

import evaluate

from hf_recattn.metrics.common import metric_info

_DESCRIPTION = "exp(sum of negative log-likelihoods / number of predicted tokens), token-weighted over blocks."
_KWARGS = """
Args:
    negative_log_likelihood: per block, the summed next-token NLL in nats.
    num_tokens: per block, how many tokens were predicted (block length - 1 for an unpadded block).
Returns:
    perplexity: exp(total NLL / total tokens); inf when the NLL is not finite.
    num_tokens: total predicted tokens.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class HeldoutPerplexity(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return metric_info(_DESCRIPTION, _KWARGS, negative_log_likelihood="float64", num_tokens="int64")

    def _compute(self, negative_log_likelihood: list[float], num_tokens: list[int]) -> dict[str, float]:
        total, count = float(sum(negative_log_likelihood)), int(sum(num_tokens))
        if count < 1:
            raise ValueError("heldout_perplexity: no predicted tokens (num_tokens sums to 0)")
        return {"perplexity": math.exp(total / count) if math.isfinite(total) else math.inf, "num_tokens": count}
