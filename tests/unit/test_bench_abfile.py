"""bench/abfile.py: result documents on disk, plain or gzipped, read back alike; and
`prefix_ab --resummarize` over a gzipped result file (no server)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from superinfer_sgl.bench import abfile, prefix_ab

ROOT = Path(__file__).resolve().parents[2]


def test_write_json_gzips_by_name_and_read_json_reads_either(tmp_path: Path) -> None:
    doc = {"runs": [{"ttft_ms": 1.5}], "note": "x" * 1000}
    abfile.write_json(tmp_path / "r.json", doc)
    abfile.write_json(tmp_path / "r.json.gz", doc)
    assert json.loads((tmp_path / "r.json").read_text()) == doc
    assert json.loads(gzip.decompress((tmp_path / "r.json.gz").read_bytes())) == doc
    assert (tmp_path / "r.json.gz").stat().st_size < (tmp_path / "r.json").stat().st_size
    assert abfile.read_json(tmp_path / "r.json") == abfile.read_json(tmp_path / "r.json.gz") == doc
    before = (tmp_path / "r.json.gz").read_bytes()
    abfile.write_json(tmp_path / "r.json.gz", doc)
    assert (tmp_path / "r.json.gz").read_bytes() == before  # the same document, the same bytes
    assert abfile.stem(tmp_path / "r.json.gz") == tmp_path / "r.json" == abfile.stem(tmp_path / "r.json")


def test_save_text_keeps_one_file_per_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(abfile, "MAX_PLAIN_BYTES", 10)
    assert abfile.save_text(tmp_path, json.dumps({"a": "long enough"})).name == abfile.GZIP
    assert abfile.find(tmp_path).name == abfile.GZIP
    monkeypatch.setattr(abfile, "MAX_PLAIN_BYTES", 1000)
    assert abfile.save_text(tmp_path, json.dumps({"a": 1})).name == abfile.PLAIN
    assert sorted(p.name for p in tmp_path.iterdir()) == [abfile.PLAIN]
    assert abfile.load(tmp_path) == {"a": 1} == abfile.load(tmp_path / abfile.PLAIN)


def test_prefix_ab_resummarizes_a_gzipped_result_file(tmp_path: Path, monkeypatch) -> None:
    # a slice of a real run's records (two arms, the same 20 requests), written gzipped
    real = abfile.read_json(ROOT / "results/prefix_cache/ab_contended.json.gz")
    runs = [{**run, "records": run["records"][:20]} for run in real["runs"] if run["arm"] in ("predictive+host", "lru")]
    monkeypatch.setattr(prefix_ab, "plot", lambda summary, path: Path(path).write_text("png"))
    path = tmp_path / "ab.json.gz"
    abfile.write_json(path, {"runs": runs, "config": real["config"]})
    assert prefix_ab.main(["--resummarize", str(path)]) == 0
    doc = abfile.read_json(path)
    assert doc["runs"] == runs and doc["summary"]["table"] and (tmp_path / "ab.png").read_text() == "png"
