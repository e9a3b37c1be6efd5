"""Multi-query associative recall: this path keeps existing imports working; the probe lives in
:mod:`hf_recattn.evaluation.recall`."""

from .evaluation.recall import *  # noqa: F403
from .evaluation.recall import __all__  # noqa: F401
