"""``python benchmarks/metadecode_bench.py``: the metadata decode measured beside safetensors' header parse."""

from __future__ import annotations

import pytest
from helpers import bench_script

metadecode = bench_script("metadecode_bench")



def test_it_times_each_operation_beside_safetensors(capsys) -> None:
    pytest.importorskip("safetensors")
    assert metadecode.main(["--entries", "40", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "40 entries, medians of 2 interleaved rounds"
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[2:]}
    assert set(rows) == {"safetensors", "index", "open_keys", "index_all", "metadata", "metadata_lazy",
                         "json"}
    assert rows["safetensors"][1] == "1.00" and all(float(us) > 0 for us, _ in rows.values())


def test_the_operations_read_the_checkpoint_they_were_given(tmp_path) -> None:
    pytest.importorskip("safetensors")
    ck, st = metadecode.make_checkpoints(str(tmp_path), 20)
    ops = metadecode.operations(ck, st)
    assert ops["safetensors"]() == ops["open_keys"]() == [f"layer{i // 8}.param{i % 8}" for i in range(20)]
    assert len(ops["index"]()[1]) == 20 and len(ops["metadata"]()[1].state_dict_metadata) == 20
    assert ops["metadata_lazy"]()[1] == ops["metadata"]()[1]


def test_mixed_ranks(tmp_path, capsys) -> None:
    pytest.importorskip("safetensors")
    ck, st = metadecode.make_checkpoints(str(tmp_path), 10, mixed=True)
    _, entries, _ = metadecode.operations(ck, st)["index"]()
    assert [e.shape for e in entries.values()] == [*metadecode.MIXED_SHAPES, *metadecode.MIXED_SHAPES]
    assert metadecode.main(["--entries", "10", "--repeats", "1", "--mixed"]) == 0
    assert capsys.readouterr().out.startswith("10 entries (mixed ranks), medians of 1 interleaved rounds")
