"""A managed step saved by two gloo ranks (DTensors, Shard(0) and Shard(1)) loads resharded into one process."""

from __future__ import annotations

import helpers
import manage_ranks
import pytest
from manage_data import blank, same, state

import mmapckpt


@pytest.mark.distributed
def test_a_two_rank_managed_save_loads_resharded_in_one_process(tmp_path):
    root = str(tmp_path / "run")
    helpers.run_distributed(manage_ranks.save_steps, 2, root)
    m = mmapckpt.CheckpointManager(root)
    assert m.steps() == [3]
    got = blank()
    assert m.load(got) == 3
    assert same(got, state(3))
    assert sorted(p.name for p in (tmp_path / "run" / "step-3").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
