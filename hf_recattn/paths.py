"""Where hf_recattn keeps derived files (converted teachers, the embedded corpus)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$HF_RECATTN_CACHE`` when set, else ``~/.cache/hf_recattn``."""
    return Path(os.environ.get("HF_RECATTN_CACHE") or Path.home() / ".cache" / "hf_recattn")
