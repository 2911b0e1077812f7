"""``python benchmarks/objstore_bench.py gs://...`` runs end to end against the GCS emulator (no timing asserted).

A tiny run (``--quick``) produces every mmapckpt row, the cache's rows (warm beside local warm, cold beside no
cache, 4 processes loading together: 1.0x the bytes), both limits through google-cloud-storage, each load
checked bitwise, DCP's FsspecReader over gcsfs, a JSON document, and leaves no object behind.
"""

from __future__ import annotations

import json

from helpers import bench_script, check_objstore_bench

objstore = bench_script("objstore_bench")


def test_bench_storage_quick_on_gcs(gs_bucket, gcs_emulator, tmp_path, capsys):
    # the emulator ignores generation preconditions (tests/gcs/conftest.py): saves take an advisory lock
    assert objstore.main([f"gs://{gs_bucket}/bench", "--storage-options", '{"require_preconditions": false}',
                          "--quick", "--repeats", "2", "--out", str(tmp_path / "out"), "--dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "out" / "bench_gs.json").read_text())
    check_objstore_bench(doc, "gcsfs")
    # gcsfs is in the test extra: DCP's own path measured on loads; its saves are not (the emulator lacks the
    # moveTo gcsfs renames with), and the row says why
    assert doc["rows"]["load: dcp.load + FsspecReader (gcsfs)"]["gb_per_s"] > 0
    assert doc["correct"]["load: dcp.load + FsspecReader (gcsfs)"]
    assert "moveTo" in doc["rows"]["save: dcp.save + FsspecWriter (gcsfs)"]["skipped"]
    assert not objstore.store_for(f"gs://{gs_bucket}/bench").objects("bench")
    assert not list(tmp_path.glob("objstore-bench-*"))  # its local checkpoint and cache removed
    assert "limits: limit: GET" in capsys.readouterr().out
