"""What ranks `display(...)`: shown in the notebook after the cell, labelled by rank.

A rank process is an IPython kernel of ipyparallel's, so `IPython.display.display(obj)`
there publishes a display message (every MIME type the object offers: HTML, PNG, plotly
JSON...), which ipyparallel brings back with the cell's reply (`AsyncResult.outputs`).
The ranks' printed lines travel another way (their output files, shown live by
streams.py); displays are shown once the cell is done, after its printed lines. The
same display on several ranks is shown once, labelled with all of them (`[ranks 0-3]`).
Outside IPython (a script) a display's text/plain form is printed.
"""

from __future__ import annotations

import json

from IPython import get_ipython
from IPython.display import publish_display_data

from tplab.errors import format_rank_list

OUTPUTS_WAIT_S = 1.0  # the display messages of a finished cell follow its reply closely


def rank_displays(ar, ranks: list[int], finished: list[int]) -> list[tuple[list[int], dict]]:
    """[(ranks, display message content)] for what the finished ranks displayed, in order;
    identical displays of several ranks are one entry."""
    if not finished:
        return []
    if len(finished) == len(ranks):
        ar.wait_for_output(OUTPUTS_WAIT_S)
    try:
        outputs = ar.outputs
    except Exception:  # noqa: BLE001 - an engine that died has no metadata left
        return []
    per_rank = {r: list(outs or []) for r, outs in zip(ranks, outputs, strict=False)
                if r in finished}
    shown: list[tuple[list[int], dict]] = []
    index: dict[tuple[int, str], int] = {}  # (position on the rank, content) -> entry
    for r in sorted(per_rank):
        for i, content in enumerate(per_rank[r]):
            key = (i, json.dumps(content.get("data", {}), sort_keys=True, default=str))
            if key in index:
                shown[index[key]][0].append(r)
            else:
                index[key] = len(shown)
                shown.append(([r], content))
    return shown


def show_rank_displays(ar, ranks: list[int], finished: list[int]) -> None:
    """Show in the notebook what the finished ranks displayed (the module docstring)."""
    entries = rank_displays(ar, ranks, finished)
    if not entries:
        return
    shell = get_ipython()
    for rs, content in entries:
        data = content.get("data", {})
        label = f"[{format_rank_list(rs)}] display:"
        if shell is None:
            print(label, data.get("text/plain", f"<{', '.join(data) or 'empty'} display>"))
            continue
        print(label, flush=True)
        publish_display_data(data, content.get("metadata") or {})
