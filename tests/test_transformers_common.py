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
import torch
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


def _cannot_roll_back(test: unittest.TestCase, *args: Any) -> None:
    test.skipTest("assisted decoding drops rejected draft tokens from the cache; a recurrent state cannot roll back "
                  "(generate() refuses: tested in test_recurrent_models_refuse_assisted_generation)")


class _RecAttnCommonTest(suite.CausalLMModelTest):
    # transformers' knobs for its overfit test, shortened for a CPU run (the loss and gradient-norm thresholds stay)
    training_overfit_steps = 150
    training_overfit_seq_length = 32
    training_overfit_learning_rate = 3e-3

    def _check_past_key_values_for_generate(
        self, batch_size: int, past_key_values: Any, seq_length: int, config: Any
    ) -> None:
        """transformers' check where every layer keeps keys and values; otherwise (the documented override point)
        the same checks on what a recurrent layer keeps: one layer per decoder layer, every token counted, the
        batch on axis 0, no ``.keys``."""
        cache = past_key_values
        if all(kind == "kv" for kind in cache.kinds):
            super()._check_past_key_values_for_generate(batch_size, cache, seq_length, config)
            return
        self.assertEqual(len(cache.layers), config.num_hidden_layers)
        for i, layer in enumerate(cache.layers):
            self.assertEqual(layer.get_seq_length(), seq_length)
            for name, tensor in layer.state.items():
                self.assertEqual(tensor.shape[0], batch_size, f"layer {i} state {name!r}")
            if layer.kind != "kv":
                with self.assertRaisesRegex(AttributeError, f"layer {i}: .* no keys"):
                    layer.keys  # noqa: B018


    def _check_caches_are_equal(self, cache1: Any, cache2: Any) -> None:
        """transformers' comparison of keys and values where every layer keeps them; else every state tensor."""
        if all(kind == "kv" for kind in cache1.kinds + cache2.kinds):
            super()._check_caches_are_equal(cache1, cache2)
            return
        self.assertEqual(cache1.kinds, cache2.kinds)
        for layer1, layer2 in zip(cache1.layers, cache2.layers, strict=True):
            self.assertEqual(layer1.get_seq_length(), layer2.get_seq_length())
            self.assertEqual(sorted(layer1.state), sorted(layer2.state))
            for name, tensor in layer1.state.items():
                torch.testing.assert_close(tensor, layer2.state[name], msg=f"layer {layer1.layer_idx} state {name!r}")


def _same_code_either_way(test: unittest.TestCase, *args: Any) -> None:
    test.skipTest("no layer dispatches through transformers' attention interface: eager and sdpa run the same code")


#: transformers' eager-vs-sdpa comparisons, one test per dtype / padding / kernel case
EAGER_VS_SDPA = [name for name in dir(suite.CausalLMModelTest) if name.startswith("test_eager_matches_sdpa_inference")]


def _padding_test(name: str) -> Any:
    """transformers' test ``name``, which its suite gates on ``has_attentions`` although it asks for no attention
    weights (it pads, or packs documents): run where the model has none."""
    test = getattr(suite.CausalLMModelTest, name)

    def run(self: unittest.TestCase) -> None:
        self.has_attentions = True  # this test instance only
        test(self)

    return run


class _RecurrentCommonTest(_RecAttnCommonTest):
    has_attentions = False  # transformers' convention for models without attention weights (output_attentions refuses)
    test_left_padding_compatibility = _padding_test("test_left_padding_compatibility")
    test_eager_padding_matches_padding_free_with_position_ids = _padding_test(
        "test_eager_padding_matches_padding_free_with_position_ids"
    )
    test_sdpa_padding_matches_padding_free_with_position_ids = _padding_test(
        "test_sdpa_padding_matches_padding_free_with_position_ids"
    )
    test_assisted_decoding_matches_greedy_search_0_random = _cannot_roll_back
    test_assisted_decoding_matches_greedy_search_1_same = _cannot_roll_back
    test_assisted_decoding_sample = _cannot_roll_back
    locals().update(dict.fromkeys(EAGER_VS_SDPA, _same_code_either_way))


class SoftmaxModelTest(_RecAttnCommonTest, unittest.TestCase):
    model_tester_class = SoftmaxTester


class GatedDeltaNetModelTest(_RecurrentCommonTest, unittest.TestCase):
    model_tester_class = GatedDeltaNetTester

    def _no_rope(self, *args: Any) -> None:
        self.skipTest("Gated DeltaNet layers take no rotary embedding (preset gdn: rope=False): nothing to scale")

    test_model_rope_scaling_from_config_0_linear = _no_rope
    test_model_rope_scaling_from_config_1_dynamic = _no_rope
    test_model_rope_scaling_from_config_2_yarn = _no_rope


class HybridModelTest(_RecurrentCommonTest, unittest.TestCase):
    model_tester_class = HybridTester
