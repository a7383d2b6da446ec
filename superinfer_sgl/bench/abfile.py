"""Where a run's results document lives: `ab.json`, or `ab.json.gz` once the text outgrows what a
tracked file may hold (1 MiB, tests/unit/test_repo_size.py). A pooled capacity report keeps every
point's per-request figures: thirteen repeats came to 1 MiB of JSON, about a fifth of that
gzipped. Readers take either name; a write removes the other so a folder never holds two.
`read_json` / `write_json`: any result file, gzipped when its name ends in `.gz`."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

PLAIN, GZIP = "ab.json", "ab.json.gz"
MAX_PLAIN_BYTES = 2**20 - 2**14  # gzip beyond this: below the tracked-file guard with a margin


def find(path: Path) -> Path:
    """The results file of a run folder (plain first), or `path` itself when it names a file."""
    path = Path(path)
    if path.is_file():
        return path
    for name in (PLAIN, GZIP):
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(f"no {PLAIN} or {GZIP} at {path}")


def read_json(path: Path) -> Any:
    """A JSON file, gunzipped first when its name ends in `.gz`."""
    data = Path(path).read_bytes()
    return json.loads(gzip.decompress(data) if str(path).endswith(".gz") else data)


def write_json(path: Path, doc: Any, indent: int | None = 1) -> None:
    """`doc` as JSON at `path`, gzipped when its name ends in `.gz`."""
    _write(Path(path), (json.dumps(doc, indent=indent, default=str) + "\n").encode())


def _write(path: Path, data: bytes) -> None:
    """`data` at `path` through a temporary file, gzipped (with a fixed header time, so the same
    document writes the same bytes) when the name ends in `.gz`."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)
    tmp.replace(path)


def stem(path: Path) -> Path:
    """`path` without `.gz`: where files named after a result file go (`stem(p).with_suffix(".png")`)."""
    path = Path(path)
    return path.with_suffix("") if path.suffix == ".gz" else path


def load(path: Path) -> dict[str, Any]:
    """The document of a run folder or results file, gzipped or not."""
    return read_json(find(path))


def save_text(out_dir: Path, text: str) -> Path:
    """Write a serialized document to out_dir: plain up to MAX_PLAIN_BYTES, gzipped above (with a
    fixed header time, so an unchanged document writes the same bytes). Returns the path written."""
    data = text.encode()
    name = PLAIN if len(data) <= MAX_PLAIN_BYTES else GZIP
    path, other = out_dir / name, out_dir / (GZIP if name == PLAIN else PLAIN)
    _write(path, data)
    other.unlink(missing_ok=True)
    return path
