"""Shared test set-up: deterministic torch, fp32 default, opt-in slow tests (HF_RECATTN_SLOW=1), Triton's
interpreter on machines without a GPU."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# Triton kernels (Liger Kernel's fused loss) run on the CPU through Triton's interpreter when no GPU is present. Triton
# reads this when a kernel is defined, so it is set before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hub_server import LocalHub  # noqa: E402


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

# third-party test files, imported by tests/transformers_suite.py, not collected on their own
collect_ignore = ["vendor"]

# the markers transformers' common test files put on their tests (tests/test_transformers_common.py)
TRANSFORMERS_MARKERS = ("accelerate_tests", "executorch_export_test", "flash_attn_3_test", "flash_attn_4_test",
                        "flash_attn_test", "generate", "onnx_export_test", "timeout", "torch_compile_test",
                        "torch_export_test")


def pytest_configure(config: pytest.Config) -> None:
    for marker in TRANSFORMERS_MARKERS:
        config.addinivalue_line("markers", f"{marker}: set by transformers' common tests")
