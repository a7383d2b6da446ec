"""What a simulator script leaves behind: its record (the command as run, when, at which commit,
the Azure traces' attribution, its rows) as JSON, and the rows' markdown table beside it."""

from __future__ import annotations

import datetime
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from superinfer_sgl.sim.workload import AZURE_ATTRIBUTION


def commit() -> str:
    """`git describe --always --dirty` of the checkout the script runs in ('' outside one)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return ""


def write(out: Path, name: str, rows: list[dict[str, Any]], table: str, **fields: Any) -> None:
    """Write `out`/`name` (the record: `fields` beside the command, date, commit, attribution and
    `rows`) and `out`/table.md, and print the table."""
    doc = {"command": shlex.join(["python", *sys.argv]),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit(), **fields, "attribution": AZURE_ATTRIBUTION, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out / "table.md").write_text(table + "\n")
    print(table)
