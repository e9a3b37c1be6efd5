"""Progress bars for the evaluation's long passes (tqdm on stderr), shown only when a label is given."""

from __future__ import annotations

from tqdm.auto import tqdm


def progress_bar(total: int, label: str | None, unit: str) -> tqdm:
    """A bar of ``total`` ``unit`` labelled ``label``; a silent one (nothing printed) when ``label`` is None.
    It disappears once its pass is done: the results say the rest."""
    return tqdm(total=total, desc=label, unit=unit, disable=label is None, leave=False, dynamic_ncols=True)
