"""transformers' own common model and generation tests, run on hf_recattn models.

In the style of transformers' ``tests/models/llama/test_modeling_llama.py``: a ``CausalLMModelTester`` subclass and a
``CausalLMModelTest`` per configuration (softmax; a recurrent one, Gated DeltaNet; a hybrid of a softmax window and
a linear far part). The mixins come from the installed transformers release (tests/transformers_suite.py).
"""

from __future__ import annotations

import unittest
from collections.abc import Iterator
from typing import Any

import pytest
import transformers_suite

from hf_recattn import RecAttnConfig, RecAttnForCausalLM, RecAttnModel

try:
    suite = transformers_suite.load()
except transformers_suite.SuiteUnavailable as error:
    pytest.skip(f"transformers' common tests are unavailable: {error}", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def _recattn_in_name_tables() -> Iterator[None]:
    with transformers_suite.registered_in_name_tables("recattn", "RecAttnModel", "RecAttnForCausalLM"):
        yield


SOFTMAX: dict[str, Any] = {"mixer": "softmax"}
GDN: dict[str, Any] = {"mixer": "gdn"}
HYBRID: dict[str, Any] = {"mixer": "hybrid", "window": 4, "far": {"mixer": "linear"}}


class _Tester(suite.CausalLMModelTester):
    base_model_class = RecAttnModel
    config_class = RecAttnConfig
    causal_lm_class = RecAttnForCausalLM
    attention: dict[str, Any] = SOFTMAX

    def __init__(self, parent: unittest.TestCase, **kwargs: Any) -> None:
        super().__init__(parent, attention=self.attention, **kwargs)


class SoftmaxTester(_Tester):
    attention = SOFTMAX


class GatedDeltaNetTester(_Tester):
    attention = GDN


class HybridTester(_Tester):
    attention = HYBRID


class _RecAttnCommonTest(suite.CausalLMModelTest):
    pass


class SoftmaxModelTest(_RecAttnCommonTest, unittest.TestCase):
    model_tester_class = SoftmaxTester


class GatedDeltaNetModelTest(_RecAttnCommonTest, unittest.TestCase):
    model_tester_class = GatedDeltaNetTester


class HybridModelTest(_RecAttnCommonTest, unittest.TestCase):
    model_tester_class = HybridTester
