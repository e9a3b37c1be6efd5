"""A Python child process in which hf_recattn cannot be imported, for tests of what works without the package.

``HIDE_HF_RECATTN`` is the child's preamble: it drops meta-path finders that can find hf_recattn (the editable
install's finder) and sys.path entries that hold it, asserts ``importlib.util.find_spec('hf_recattn') is None``,
and puts a blocker first on ``sys.meta_path``. Run the child with ``python -I`` from an empty folder.
"""

from __future__ import annotations

import textwrap

HIDE_HF_RECATTN = textwrap.dedent(
    r"""
    import importlib.machinery, importlib.util, json, sys

    def _finds(finder):
        try:
            return finder.find_spec("hf_recattn", None) is not None
        except Exception:
            return False

    # 1. hide hf_recattn: meta-path finders that find it (editable installs), then path entries that hold it
    sys.meta_path[:] = [f for f in sys.meta_path if f is importlib.machinery.PathFinder or not _finds(f)]
    sys.path[:] = [p for p in sys.path if importlib.machinery.PathFinder.find_spec("hf_recattn", [p]) is None]
    importlib.invalidate_caches()
    assert importlib.util.find_spec("hf_recattn") is None, "hf_recattn is still importable"

    class _Blocker:
        def find_spec(self, name, path=None, target=None):
            if name == "hf_recattn" or name.startswith("hf_recattn."):
                raise ModuleNotFoundError(f"blocked in this test: {name}")
            return None

    sys.meta_path.insert(0, _Blocker())
    """
)
