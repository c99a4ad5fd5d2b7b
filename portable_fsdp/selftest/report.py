"""The self-test's table and selftest.json. Imports no framework."""
from __future__ import annotations

import json
import pathlib

REPORT = "selftest.json"


def result_word(row: dict) -> str:
    if row.get("skipped"):
        return "skipped"
    return "pass" if row["passed"] else "FAIL"


def table(rows: list) -> str:
    """One line per row: feature, pass / FAIL / skipped, largest relative loss difference, seconds, the figure
    (or why it failed or was skipped)."""
    header = ["feature", "result", "max rel diff", "time (s)", "figure"]
    body = []
    for row in rows:
        difference = f"{row['max_rel_diff']:.1e}" if "max_rel_diff" in row else "-"
        seconds = f"{row['seconds']:.0f}" if "seconds" in row else "-"
        note = row.get("error") or row.get("skipped") or row.get("figure", "")
        body.append([row["feature"], result_word(row), difference, seconds, note])
    widths = [max(len(cells[i]) for cells in [header, *body]) for i in range(len(header) - 1)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)) + "  " + cells[-1]  # noqa: E731
    return "\n".join([line(header), *map(line, body)])


def write(directory: pathlib.Path, summary: dict) -> pathlib.Path:
    """`summary` ({"backend", ..., "rows": [...]}) as selftest.json in `directory`, written whole or not at all."""
    path = pathlib.Path(directory) / REPORT
    staging = path.with_name(f".{REPORT}.tmp")
    staging.write_text(json.dumps(summary, indent=1) + "\n")
    staging.replace(path)
    return path


def failed(rows: list) -> list:
    return [row["feature"] for row in rows if not row.get("skipped") and not row["passed"]]
