"""transformers' own common test machinery (``ModelTesterMixin``, ``GenerationTesterMixin``, ``CausalLMModelTest``)
for the installed transformers release.

The release's source distribution ships the top-level ``tests/*.py`` (``test_modeling_common.py``,
``test_configuration_common.py``, the pipeline / training / tensor-parallel mixins): those are fetched once through
pip, checked against a pinned sha256 and kept in hf_recattn's cache folder. The few files the sdist lacks
(``causal_lm_tester.py``, ``generation/test_utils.py``, ``exporters/test_export.py``, ``utils/
test_configuration_utils.py``) are vendored unmodified under ``tests/vendor/transformers_tests/`` (see its
README). Both folders form one package, ``transformers_tests``, so the files' relative imports resolve.

Four adaptations happen here, none inside the third-party files: the testers' defaults that 5.24's
``testing_utils`` no longer defines, a stand-in ``distributed_testing_utils`` (multi-process tests skip), the
``tests.`` absolute import of ``generation/test_utils.py``, and hf_recattn's model type in transformers' name tables
(the common tests recognise base models and LM heads by class name there; see :func:`registered_in_name_tables`).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import unittest
from collections.abc import Iterator
from pathlib import Path

import transformers

from hf_recattn.paths import cache_root

PACKAGE = "transformers_tests"
VENDOR = Path(__file__).parent / "vendor" / "transformers_tests"
# sha256 of transformers' sdist on the package index, per release this suite was checked with.
SDIST_SHA256 = {"5.24.0": "906cb8c3cb2123575e263962586a4d21a979ce97feeb95fe6aaf66fe6ae88bf3"}

# The text testers' defaults, as transformers' testing_utils defined them for the vendored causal_lm_tester.py.
TEXT_MODEL_TESTER_DEFAULTS = {
    "batch_size": 13, "seq_length": 7, "is_training": True, "use_input_mask": True, "use_labels": True,
    "vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "intermediate_size": 32, "hidden_act": "gelu", "max_position_embeddings": 512,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "expert_interval": 1, "moe_layer_start_index": 0,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 36, "shared_expert_gate": True,
    "moe_num_shared_experts": 2, "num_experts_per_tok": 2, "num_experts": 8,
}  # fmt: skip


class SuiteUnavailable(RuntimeError):
    """The common tests cannot be had for the installed transformers release."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_sdist(version: str, into: Path) -> Path:
    """``pip download`` transformers' sdist for ``version`` into ``into``; returns the archive."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", f"transformers=={version}", "-d", str(into)]  # fmt: skip
    if importlib.util.find_spec("setuptools") is not None:  # pip reads the sdist's metadata: skip the build env
        command.insert(-4, "--no-build-isolation")
    done = subprocess.run(command, capture_output=True, text=True)
    archives = sorted(into.glob(f"transformers-{version}.tar.gz"))
    if done.returncode != 0 or not archives:
        raise SuiteUnavailable(f"pip could not download transformers=={version} (sdist): {done.stderr[-2000:]}")
    return archives[0]


def _extract_tests(archive: Path, version: str, root: Path) -> None:
    """Lay out ``root`` as the test files expect a transformers checkout: the sdist's top-level ``tests/*.py`` and
    LICENSE under ``root/tests``, with two empty package markers (``tests/__init__.py``, empty in the repository
    and omitted by the sdist; ``src/transformers/__init__.py``, which ``test_pipeline_mixin.py`` executes only to
    get at ``sys.modules["transformers"]``, the installed release), and an empty tiny-model summary for
    ``TRANSFORMERS_TINY_MODEL_PATH`` (pipeline tests take their tiny models from the Hub: none here)."""
    prefix = f"transformers-{version}/"
    tests = root / "tests"
    for folder in (tests, root / "src" / "transformers", root / "tiny_models" / "reports"):
        folder.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            relative = member.name[len(prefix) :] if member.name.startswith(prefix) else ""
            wanted = relative == "LICENSE" or (
                relative.startswith("tests/") and relative.endswith(".py") and relative.count("/") == 1
            )
            if wanted and member.isfile():
                source = tar.extractfile(member)
                assert source is not None
                (tests / Path(relative).name).write_bytes(source.read())
    (tests / "__init__.py").write_text("")
    (root / "src" / "transformers" / "__init__.py").write_text("")
    (root / "tiny_models" / "reports" / "tiny_model_summary.json").write_text("{}")


def sdist_tests(version: str | None = None) -> Path:
    """The folder laid out from the release's sdist (see ``_extract_tests``), fetched on first use: sha256
    checked, placed atomically."""
    version = version or transformers.__version__
    expected = SDIST_SHA256.get(version)
    if expected is None:
        raise SuiteUnavailable(
            f"no pinned sdist checksum for transformers {version} (known: {sorted(SDIST_SHA256)}); "
            "add its sha256 to SDIST_SHA256 after checking the vendored files still fit"
        )
    target = cache_root() / "transformers_tests" / version
    marker = target / "tests" / "test_modeling_common.py"
    if marker.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as scratch:
        archive = _download_sdist(version, Path(scratch))
        actual = _sha256(archive)
        if actual != expected:
            raise SuiteUnavailable(f"transformers {version} sdist sha256 {actual} != pinned {expected}")
        staged = Path(scratch) / "root"
        _extract_tests(archive, version, staged)
        if not (staged / "tests" / "test_modeling_common.py").is_file():
            raise SuiteUnavailable(f"transformers {version} sdist has no tests/test_modeling_common.py")
        with contextlib.suppress(OSError):  # another process may have put it there first
            os.replace(staged, target)
    if not marker.is_file():
        raise SuiteUnavailable(f"could not place transformers' test files in {target}")
    return target


def _skip_distributed(*args: object, **kwargs: object) -> None:
    raise unittest.SkipTest("multi-process distributed tests are not run in this suite")


#: the helpers the mixins import from ``distributed_testing_utils``
DISTRIBUTED_HELPERS = ("run_distributed", "_get_distributed_backend", "_get_distributed_device_type",
                       "_get_rank_device", "_set_rank_device", "_start_rank_processes")


def _distributed_stand_in() -> types.ModuleType:
    """``distributed_testing_utils`` (neither in the sdist nor vendored): every helper skips its test."""
    module = types.ModuleType(f"{PACKAGE}.distributed_testing_utils")
    for name in DISTRIBUTED_HELPERS:
        setattr(module, name, _skip_distributed)
    return module


def _configuration_utils() -> types.ModuleType:
    """``utils/test_configuration_utils.py`` is a test module of its own (it needs transformers' repository-only
    ``utils/test_module``); ``test_configuration_common.py`` takes only its ``config_common_kwargs``, read here from
    the vendored file's literal."""
    source = VENDOR / "utils" / "test_configuration_utils.py"
    tree = ast.parse(source.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["config_common_kwargs"]:
            module = types.ModuleType(f"{PACKAGE}.utils.test_configuration_utils")
            module.config_common_kwargs = ast.literal_eval(node.value)
            return module
    raise SuiteUnavailable(f"{source} defines no config_common_kwargs literal")


def _package(root: Path) -> types.ModuleType:
    spec = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [str(root / "tests"), str(VENDOR)]
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    sys.modules[f"{PACKAGE}.distributed_testing_utils"] = _distributed_stand_in()
    importlib.import_module(f"{PACKAGE}.utils")
    sys.modules[f"{PACKAGE}.utils.test_configuration_utils"] = _configuration_utils()
    return package


@contextlib.contextmanager
def _aliased_as_tests(package: types.ModuleType) -> Iterator[None]:
    """``generation/test_utils.py`` imports ``tests.exporters.test_export``: alias it while importing."""
    export = importlib.import_module(f"{PACKAGE}.exporters.test_export")
    aliases = {
        "tests": package,
        "tests.exporters": sys.modules[f"{PACKAGE}.exporters"],
        "tests.exporters.test_export": export,
    }
    saved = {name: sys.modules.get(name) for name in aliases}
    sys.modules.update(aliases)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def load() -> types.ModuleType:
    """Import and return the vendored ``causal_lm_tester`` module (``CausalLMModelTester``, ``CausalLMModelTest``)."""
    name = f"{PACKAGE}.causal_lm_tester"
    if name in sys.modules:
        return sys.modules[name]
    root = sdist_tests()
    os.environ.setdefault("TRANSFORMERS_TINY_MODEL_PATH", str(root / "tiny_models"))
    package = _package(root)
    testing_utils = importlib.import_module("transformers.testing_utils")
    if not hasattr(testing_utils, "_TEXT_MODEL_TESTER_DEFAULTS"):
        testing_utils._TEXT_MODEL_TESTER_DEFAULTS = dict(TEXT_MODEL_TESTER_DEFAULTS)
    with _aliased_as_tests(package):
        return importlib.import_module(name)


@contextlib.contextmanager
def registered_in_name_tables(model_type: str, base: str, causal_lm: str) -> Iterator[None]:
    """Put ``model_type`` in transformers' base-model and causal-LM name tables for the duration.

    The common tests decide by class name whether a class is an LM head (labels for ``test_training``) or a base
    model; a model registered from outside transformers is missing from those tables.
    """
    from transformers.models.auto import modeling_auto

    tables = {"MODEL_MAPPING_NAMES": base, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": causal_lm}
    for table, class_name in tables.items():
        getattr(modeling_auto, table)[model_type] = class_name
    try:
        yield
    finally:
        for table in tables:
            getattr(modeling_auto, table).pop(model_type, None)

