"""Batched generate() with prompts of very different lengths: every left-padded row decodes as the same prompt alone.

test_generation.py checks the most padded row of a batch whose padding stays within one chunk; here the padding
of the shortest rows spans several chunks (the tiny models' chunk is 4 tokens) and more than the window (3), and
every row is checked, for every mixer and the models mixing mixers.
"""

from __future__ import annotations

import pytest
import torch
from generation_cases import PAD, Case, case_params, left_padded_batch, one_thread, tiny_model

LENGTHS = (1, 2, 9, 14)  # padding 13, 12 and 5 tokens
NEW = 5


@pytest.mark.parametrize("case", case_params())
def test_every_left_padded_row_decodes_as_alone(case: Case) -> None:
    one_thread()
    model = tiny_model(case)
    ids, mask = left_padded_batch(LENGTHS)
    options = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, output_logits=True,
                   return_dict_in_generate=True)
    with torch.no_grad():
        together = model.generate(ids, attention_mask=mask, **options)
        for row, length in enumerate(LENGTHS):
            alone = model.generate(ids[row, -length:][None], attention_mask=torch.ones(1, length, dtype=mask.dtype),
                                   **options)
            assert torch.equal(together.sequences[row, -NEW:], alone.sequences[0, -NEW:]), f"row {row} ({length})"
            torch.testing.assert_close(torch.stack(together.logits)[:, row], torch.stack(alone.logits)[:, 0],
                                       rtol=0, atol=1e-4)
