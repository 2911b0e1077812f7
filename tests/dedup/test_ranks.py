"""A 2-rank gloo save of two steps, the second referring to the first's chunks, and a 1-rank resharded load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import mmapckpt
from dedup_ranks import full, save_two_steps
from helpers import assert_bitwise_equal, run_distributed
from mmapckpt.storage.commits import read_index_file
from roots import make_root, metadata_doc


@pytest.mark.distributed
def test_two_ranks_refer_to_their_own_chunks_of_the_previous_step_and_one_rank_loads_it(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    run_distributed(save_two_steps, 2, str(root))
    _, entries, _ = read_index_file(root / "step-2" / ".metadata")
    frozen = {c.offsets: c.file for c in entries["frozen"].chunks}
    assert frozen == {(0, 0): "../step-1/__0_0.distcp", (19, 0): "../step-1/__1_0.distcp"}  # each rank's own
    assert all(not c.file.startswith("../") for c in entries["trained"].chunks)
    assert entries["rep"].chunks[0].file.startswith("../step-1/")
    assert set(metadata_doc(root / "step-2")["storage_meta"]["references"]) == {
        "../step-1/__0_0.distcp", "../step-1/__1_0.distcp"}
    got = mmapckpt.load(root / "step-2")
    targets = {k: torch.empty_like(full(k, 2)) for k in ("frozen", "trained", "rep")} | {"step": 0}
    dcp.load(targets, storage_reader=mmapckpt.MmapReader(root / "step-2"), no_dist=True)  # 2 ranks -> 1
    for k in ("frozen", "trained", "rep"):
        assert_bitwise_equal(got[k], full(k, 2), k)
        assert_bitwise_equal(targets[k], full(k, 2), k)
    assert targets["step"] == 2
    assert not mmapckpt.verify_checkpoint(root / "step-2").problems
