"""glibc's mmap threshold for the long-running commands (convert, pretrain, finetune): fixed, so that the large
blocks a training step frees go back to the system instead of fragmenting the heap (docs/conversion.md, "Scale").

glibc's ``malloc`` serves requests below its mmap threshold from the heap and, by default, raises the threshold
each time a larger mapped block is freed (up to 32 MiB); a training step's activations then stay in the heap after
they are freed, and the resident set climbs well above what is alive. ``mallopt(M_MMAP_THRESHOLD, n)`` fixes the
threshold at ``n`` bytes, which also turns that adjustment off. Nothing here changes what is computed.

This module imports nothing else from the package (nor torch), so that the command line may use it at any point.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

#: ``mallopt``'s parameter number for the mmap threshold (glibc's <malloc.h>)
M_MMAP_THRESHOLD = -3
#: the threshold the commands set unless told otherwise: requests of 2 MiB and more are mapped on their own. Measured
#: (docs/conversion.md, "Qwen3 shapes on the CPU"): both stages peak within 1.1x the formulas' bytes on SmolLM2-135M's
#: and Qwen3-0.6B's shapes (4 MiB: up to 1.16x; glibc's own threshold: 1.4-1.6x), for more system time per step
#: (page faults; 1 MiB: the same bound for as much system time or more)
DEFAULT_MMAP_THRESHOLD = 2 * 2**20
#: glibc's documented upper limit on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX, 4 * 1024 * 1024 * sizeof(long))
MAX_MMAP_THRESHOLD = 32 * 2**20
#: the command-line option that sets it (named in errors)
OPTION = "--malloc-mmap-threshold"


def malloc_tuned_by(environ: Mapping[str, str]) -> str | None:
    """The environment variable through which the user tunes ``malloc`` (``MALLOC_*``, or ``GLIBC_TUNABLES`` with
    a ``glibc.malloc.`` tunable), or None."""
    for name in sorted(environ):
        if name.startswith("MALLOC_"):
            return name
    return "GLIBC_TUNABLES" if "glibc.malloc." in environ.get("GLIBC_TUNABLES", "") else None


def chosen_threshold(value: int | None, environ: Mapping[str, str]) -> int | None:
    """The threshold to set for ``value`` (the option: None when not given, 0 for glibc's own behaviour), or None
    where glibc is left alone: ``value`` 0, or no ``value`` while the environment tunes ``malloc``."""
    if value is not None and not 0 <= value <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"{OPTION} must be between 0 (glibc's default) and {MAX_MMAP_THRESHOLD} bytes, got {value}")
    if value == 0:
        return None
    if value is None:
        tuned = malloc_tuned_by(environ)
        if tuned is not None:
            log.debug("%s is set: glibc's malloc left as the environment tunes it", tuned)
            return None
        return DEFAULT_MMAP_THRESHOLD
    return value


def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc, else None (macOS, musl, Windows)."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):  # no confstr, or no such name: not glibc
        return None
    if not version or not version.startswith("glibc"):
        return None
    libc = ctypes.CDLL(None)
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return libc


def fix_mmap_threshold(value: int | None = None, environ: Mapping[str, str] | None = None) -> int | None:
    """Fix glibc's mmap threshold at ``value`` bytes (None: ``DEFAULT_MMAP_THRESHOLD`` unless the environment tunes
    ``malloc``; 0: leave glibc alone). Returns the threshold set, or None where nothing was set (a C library other
    than glibc is no error). A bad ``value`` is a ValueError naming the option."""
    threshold = chosen_threshold(value, os.environ if environ is None else environ)
    if threshold is None:
        return None
    libc = _glibc()
    if libc is None:
        log.debug("not glibc: %s has no effect", OPTION)
        return None
    if libc.mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        log.warning("glibc refused mallopt(M_MMAP_THRESHOLD, %d): its malloc keeps its own threshold", threshold)
        return None
    log.debug("glibc's mmap threshold fixed at %d bytes", threshold)
    return threshold
