"""``python benchmarks/objstore_bench.py az://...`` runs end to end against Azurite (no timing is asserted).

A tiny run (``--quick``) produces every mmapckpt row, the cache's rows (warm beside local warm, cold beside no
cache, 4 processes loading together: 1.0x the bytes), both limits through azure-storage-blob, each load
checked bitwise, DCP's FsspecReader/FsspecWriter over adlfs, a JSON document, and leaves no blob behind.
"""

from __future__ import annotations

import json

from helpers import bench_script, check_objstore_bench

objstore = bench_script("objstore_bench")


def test_bench_storage_quick_on_azure(az_env, az_container, azurite, tmp_path, capsys):
    assert objstore.main([f"az://{az_container}/bench", "--quick", "--repeats", "2", "--out", str(tmp_path / "out"),
                          "--dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "out" / "bench_az.json").read_text())
    check_objstore_bench(doc, "adlfs")
    for row in ("load: dcp.load + FsspecReader (adlfs)", "save: dcp.save + FsspecWriter (adlfs)"):
        assert doc["rows"][row]["gb_per_s"] > 0, row  # adlfs is in the test extra: DCP's own path, measured
    assert not list(azurite.service().get_container_client(az_container).list_blobs())
    assert not list(tmp_path.glob("objstore-bench-*"))  # its local checkpoint and cache removed
    assert "limits: limit: GET" in capsys.readouterr().out


def test_bench_loads_only_on_azure(az_container, az_env, tmp_path):
    """``--loads-only``: the loads and the GET limits timed, no save row and no PUT limit; the fsspec load reads the
    checkpoint FsspecWriter saved once, untimed, and every load is bitwise."""
    assert objstore.main([f"az://{az_container}/bench", "--loads-only", "--quick", "--out", str(tmp_path / "out"),
                          "--dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "out" / "bench_az.json").read_text())
    assert not [n for n in doc["rows"] if n.startswith(("save", "limit: PUT"))]
    assert doc["limits"]["put"] is None and doc["limits"]["get"]
    assert doc["rows"]["load: mmapckpt.load_into"]["of_limit"] > 0
    assert doc["rows"]["load: dcp.load + FsspecReader (adlfs)"]["gb_per_s"] > 0
    assert all(doc["correct"].values())
