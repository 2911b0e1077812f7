"""The writer hands a commit's cross-step references to the metadata encoder explicitly (not inside a ``str``
subclass of the save id): the ``.metadata`` records them as docs/format.md 3.4 says, the save id stays a str."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mmapckpt import MmapWriter
from mmapckpt.format.metadata import encode_metadata
from mmapckpt.reading.shard import Shard
from roots import frozen_and_trained, make_root, metadata_doc, save_step

pytest.importorskip("blake3")


def test_a_commit_records_each_referenced_file_and_the_save_id_it_carries(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    save_step(root, 1, frozen_and_trained())
    sd = frozen_and_trained()
    sd["head.w"] = torch.ones(64, 8)
    w = MmapWriter(root / "step-2", overwrite=False, reuse=[root / "step-1"])
    md = dcp.save(sd, storage_writer=w, no_dist=True)
    assert type(md.storage_meta.save_id) is str and md.storage_meta.save_id == w.save_id
    (shard,) = (root / "step-1").glob("*.distcp")
    s1 = Shard(str(shard))
    sid1 = s1.save_id
    s1.close()
    sm = metadata_doc(root / "step-2")["storage_meta"]
    assert sm["save_id"] == w.save_id and sm["references"] == {f"../step-1/{shard.name}": sid1}
    assert "references" not in metadata_doc(root / "step-1")["storage_meta"]


def test_references_need_metadata_version_2(tmp_path: Path) -> None:
    save_step(make_root(tmp_path / "root"), 1, frozen_and_trained())
    md = dcp.save(frozen_and_trained(), storage_writer=MmapWriter(tmp_path / "plain"), no_dist=True)
    with pytest.raises(ValueError, match="version 2"):
        encode_metadata(md, major=1, references={"../step-1/f": "x"})
    assert b'"references"' in encode_metadata(md, references={"../step-1/f": "x"})
