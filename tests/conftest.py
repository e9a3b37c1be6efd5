"""Shared test set-up: deterministic torch, fp32 default, opt-in slow tests (HF_RECATTN_SLOW=1)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hub_server import LocalHub


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("HF_RECATTN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set HF_RECATTN_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_threads() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny tensors: a second thread only adds contention


@pytest.fixture
def local_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHub]:
    """A Hub-compatible test server (tests/hub_server.py) on 127.0.0.1; ``.endpoint`` goes in HF_ENDPOINT."""
    with LocalHub(tmp_path_factory.mktemp("hub")) as hub:
        yield hub
