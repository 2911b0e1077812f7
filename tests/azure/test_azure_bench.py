"""``python benchmarks/objstore_bench.py az://...`` runs end to end against Azurite (no timing is asserted).

A tiny run (``--quick``) produces every mmapckpt row, the cache's rows (warm beside local warm, cold beside no
cache, 4 processes loading together: 1.0x the bytes), both limits through azure-storage-blob, each load
checked bitwise, a JSON document, and leaves no blob behind.
"""

from __future__ import annotations

import json

from helpers import bench_script

objstore = bench_script("objstore_bench")


def test_bench_storage_quick_on_azure(az_env, az_container, azurite, tmp_path, capsys):
    assert objstore.main([f"az://{az_container}/bench", "--quick", "--repeats", "2", "--out", str(tmp_path / "out"),
                          "--dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "out" / "bench_az.json").read_text())
    rows = doc["rows"]
    for row in ("save: dcp.save + MmapWriter", "load: mmapckpt.load_into", "load: dcp.load + MmapReader",
                "load: dcp.load + MmapReader + FastLoadPlanner", "load: mmapckpt.load (new tensors)",
                "load: load_into, cache cold"):
        assert rows[row]["gb_per_s"] > 0 and "of_limit" in rows[row], row
    for row in ("load: load_into, cache warm", "load: load_into, local disk warm",
                "load: 4 processes, one URL, cache cold"):
        assert rows[row]["gb_per_s"] > 0, row
    assert doc["limits"]["get"].startswith("limit: GET") and doc["limits"]["put"].startswith("limit: PUT")
    assert doc["correct"] and all(doc["correct"].values()), doc["correct"]
    assert "load: 4 processes, one URL, cache cold" in doc["correct"]
    assert doc["cache"]["fetched_of_size_together"] == 1.0  # each byte fetched once across the processes
    assert doc["server_pids_found"]  # the fixture's Azurite runs here: its CPU is counted
    assert "DCP FsspecWriter/FsspecReader" in rows or "load: dcp.load + FsspecReader (adlfs)" in rows
    assert not list(azurite.service().get_container_client(az_container).list_blobs())
    assert not list(tmp_path.glob("objstore-bench-*"))  # its local checkpoint and cache removed
    assert "limits: limit: GET" in capsys.readouterr().out
