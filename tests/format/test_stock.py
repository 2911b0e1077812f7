"""Stock DCP items read through mmapckpt: bounds, weights_only, typed errors, via the reader."""

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import mmapckpt
from helpers import dcp_failure, dcp_load
from mmapckpt.format.stock import load_tensor


def _stock_checkpoint(path):
    dcp.save({"w": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        md = pickle.load(f)  # the stock file written just above
    (idx, info), = [(i, s) for i, s in md.storage_data.items() if i.fqn == "w"]
    return os.path.join(path, info.relative_path), info, md, meta


def test_load_tensor_accepts_a_tensor_and_refuses_other_objects():
    buf = io.BytesIO()
    torch.save(torch.tensor([1.5, -0.0]), buf)
    t = load_tensor(buf.getvalue(), path="f", entry="e")
    assert t.tolist() == [1.5, -0.0]
    buf = io.BytesIO()
    torch.save({"not": "a tensor"}, buf)
    with pytest.raises(mmapckpt.FormatError, match="not a tensor") as ei:
        load_tensor(buf.getvalue(), path="f", entry="e")
    assert ei.value.path == "f" and ei.value.entry == "e"
    with pytest.raises(mmapckpt.FormatError, match="could not be loaded"):
        load_tensor(b"garbage", path="f", entry="e")


def test_reading_an_item_past_the_end_is_refused(tmp_path):
    from mmapckpt.storage.local import LocalFile

    p = tmp_path / "x"
    p.write_bytes(b"0123456789")
    with LocalFile(str(p)) as f:
        assert bytes(f.read(2, 5, entry="e")) == b"23456"
        with pytest.raises(mmapckpt.TruncatedFileError, match="runs past the end"):
            f.read(8, 5, entry="e")


def test_reader_on_a_stock_item_replaced_by_a_non_tensor(tmp_path):
    """The item is a valid torch.save of a list (a stock writer's bytes, as metadata says): refused by type."""
    shard, info, md, meta = _stock_checkpoint(str(tmp_path))
    buf = io.BytesIO()
    torch.save([1, 2, 3], buf)
    with open(shard, "ab") as f:
        offset = f.tell()
        f.write(buf.getvalue())
    info.offset, info.length = offset, len(buf.getvalue())
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(BaseException) as ei:
        dcp_load({"w": torch.zeros(6)}, mmapckpt.MmapReader(str(tmp_path)))
    err = dcp_failure(ei.value)
    assert isinstance(err, mmapckpt.FormatError), repr(err)
    assert "holds list, not a tensor" in str(err)
    assert shard in str(err) and "'w" in str(err)


def test_stock_metadata_of_older_torch_with_the_legacy_tensor_properties_loads(tmp_path):
    """Older torch pickled torch.distributed._shard.sharded_tensor.metadata.TensorProperties into
    .metadata; the stock reader loads such checkpoints, so MmapReader and mmapckpt.load must too."""
    import pickle

    import torch.distributed._shard.sharded_tensor.metadata as legacy
    import torch.distributed.checkpoint as dcp

    import mmapckpt
    from helpers import assert_tree_equal

    sd = {"w": torch.randn(4, 5).to(torch.bfloat16), "i": torch.arange(6), "step": 7}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        md = pickle.load(f)
    for item in md.state_dict_metadata.values():
        if hasattr(item, "properties"):
            p = item.properties
            item.properties = legacy.TensorProperties(dtype=p.dtype, requires_grad=p.requires_grad)
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    assert b"sharded_tensor.metadata" in (tmp_path / ".metadata").read_bytes()
    targets = {"w": torch.zeros(4, 5, dtype=torch.bfloat16), "i": torch.zeros(6, dtype=torch.int64), "step": 0}
    dcp.load(targets, storage_reader=mmapckpt.MmapReader(tmp_path), no_dist=True)
    assert_tree_equal(targets, sd)
    loaded = mmapckpt.load(tmp_path)
    assert_tree_equal(loaded, {"w": sd["w"], "i": sd["i"]})


def test_a_rank_local_lookup_of_a_collective_checkpoint_is_not_called_incomplete(tmp_path):
    import mmapckpt
    from mmapckpt.storage.local import LocalStorage

    mmapckpt.save({"w": torch.ones(2)}, tmp_path)
    with pytest.raises(mmapckpt.CheckpointNotFoundError, match="commit is .metadata"):
        LocalStorage(str(tmp_path)).find_metadata(rank=0)
