"""``python benchmarks/objstore_bench.py s3://...`` runs end to end against the real radosgw (no timing is asserted).

A tiny run (``--quick``) produces every mmapckpt row and both limits, each load checked bitwise,
DCP's FsspecWriter/FsspecReader rows, a JSON document, and leaves no object or upload behind.
"""

from __future__ import annotations

import json

from helpers import bench_script

objstore = bench_script("objstore_bench")


def test_bench_storage_quick(s3_env, s3_bucket, s3_server, tmp_path, capsys):
    # two repetitions: the second save takes another shard name (the first is committed)
    assert objstore.main([f"s3://{s3_bucket}/bench", "--quick", "--repeats", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_s3.json").read_text())
    rows = doc["rows"]
    for row in ("save: dcp.save + MmapWriter", "load: mmapckpt.load_into", "load: dcp.load + MmapReader",
                "load: dcp.load + MmapReader + FastLoadPlanner", "load: mmapckpt.load (new tensors)",
                "save: dcp.save + FsspecWriter (s3fs)", "load: dcp.load + FsspecReader (s3fs)"):
        assert rows[row]["gb_per_s"] > 0 and "of_limit" in rows[row], row
    assert doc["limits"]["get"].startswith("limit: GET") and doc["limits"]["put"].startswith("limit: PUT")
    assert doc["correct"] and all(doc["correct"].values()), doc["correct"]
    assert doc["server_pids_found"]  # the fixture's radosgw runs here: its CPU is counted
    client = s3_server.client()
    assert not client.list_objects_v2(Bucket=s3_bucket).get("Contents")
    assert not client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads")
    assert "limits: limit: GET" in capsys.readouterr().out
