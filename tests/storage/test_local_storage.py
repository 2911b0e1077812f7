"""The local implementation of the storage seam (storage/local.py): what every reader and writer relies on."""

from __future__ import annotations

import os

import pytest

import mmapckpt
from mmapckpt.storage.commits import remove_stale
from mmapckpt.storage.local import LocalFile, LocalStorage


def _file(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def test_a_file_reads_by_range_and_maps_the_inode_it_opened(tmp_path) -> None:
    p = _file(tmp_path / "f", bytes(range(256)) * 64)
    with LocalFile(p) as f:
        _file(tmp_path / "g", b"\x00" * f.size)
        os.replace(tmp_path / "g", p)  # the path now names another file
        buf = bytearray(16)
        f.read_into(100, buf)
        assert bytes(buf) == bytes(range(100, 116))  # still the file opened
        assert bytes(f.mapping.raw(200, 4).numpy()) == bytes(range(200, 204))
        assert bytes(f.read(255, 2)) == bytes([255, 0])
        with pytest.raises(mmapckpt.TruncatedFileError, match="runs past the end"):
            f.read(f.size - 1, 2)


def test_a_file_that_shrank_is_reported(tmp_path) -> None:
    p = _file(tmp_path / "f", b"x" * 8192)
    f = LocalFile(p)
    f.mapping  # mapped first
    os.truncate(p, 100)
    with pytest.raises(mmapckpt.TruncatedFileError, match="shrank"):
        f.check_unchanged()
    f.close()
    g = LocalFile(p)  # not mapped: the descriptor's size tells
    os.truncate(p, 10)
    with pytest.raises(mmapckpt.TruncatedFileError, match="shrank"):
        g.check_unchanged()
    g.close()


def test_not_a_regular_file_and_a_missing_one_are_typed(tmp_path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(mmapckpt.CheckpointError, match="not a regular file"):
        LocalFile(str(tmp_path / "fifo"))
    with pytest.raises(mmapckpt.IncompleteCheckpointError, match="missing"):
        LocalStorage(str(tmp_path)).open_file("nope")


def test_a_name_leaving_the_directory_is_refused(tmp_path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    _file(tmp_path / "outside", b"secret")
    os.symlink(tmp_path / "outside", d / "link")
    with pytest.raises(mmapckpt.UnsafePathError):
        LocalStorage(str(d)).open_file("link")
    with pytest.raises(mmapckpt.UnsafePathError):
        LocalStorage(str(d)).open_file("../outside")


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_shard_appears_only_when_finished_with_its_head_first(tmp_path, direct: bool) -> None:
    st = LocalStorage(str(tmp_path))
    size, head = 3 * 4096 + 100, 4096
    out = st.create_file("__0_0.distcp", size, head=head, direct=direct, sync=True)
    out.put(4096, b"a" * 4096)
    out.put(8192 + 10, b"b" * 100)  # the gap reads as zeros
    assert st.list() != [] and not st.exists("__0_0.distcp")  # only the temporary file so far
    out.finish(b"HEAD")
    data = open(tmp_path / "__0_0.distcp", "rb").read()
    assert len(data) == size
    assert data[:4] == b"HEAD" and data[4:4096] == bytes(4092)
    assert data[4096:8192] == b"a" * 4096 and data[8192:8202] == bytes(10) and data[8202:8302] == b"b" * 100
    assert st.list() == ["__0_0.distcp"]  # no temporary file left
    # O_DIRECT where asked for and the filesystem takes it (tmpfs refuses it: then buffered)
    assert out.how in (("direct", "buffered") if direct else ("buffered",))


def test_an_aborted_shard_leaves_nothing(tmp_path) -> None:
    st = LocalStorage(str(tmp_path))
    out = st.create_file("__0_0.distcp", 8192, head=4096, direct=True, sync=False)
    out.put(4096, b"x" * 10)
    out.abort()
    assert st.list() == []


def test_the_commit_replaces_whole_and_remove_stale_spares_what_is_not_ours(tmp_path) -> None:
    path = str(tmp_path / "c")
    import torch

    mmapckpt.save({"w": torch.ones(3)}, path)
    st = LocalStorage(path)
    _file(os.path.join(path, "notes.txt"), b"keep")
    _file(os.path.join(path, "__0_9.distcp"), b"left over by a killed save")
    _file(os.path.join(path, ".__0_3.distcp.tmp-abc123"), b"temporary")
    remove_stale(st, keep_commit=".metadata", keep_files={"__0_0.distcp"}, rank_prefix=None, sync=True)
    assert sorted(st.list()) == [".metadata", "__0_0.distcp", "notes.txt"]
    st.commit("x.json", b"one", sync=True)
    st.commit("x.json", b"two", sync=False)
    assert open(os.path.join(path, "x.json"), "rb").read() == b"two"
    assert torch.equal(mmapckpt.load(path)["w"], torch.ones(3))


def test_the_lock_excludes_a_second_save(tmp_path) -> None:
    st = LocalStorage(str(tmp_path))
    lock = st.lock()
    try:
        with pytest.raises(mmapckpt.CheckpointWriteError, match="in progress"):
            LocalStorage(str(tmp_path)).lock()
    finally:
        lock.release()
    st.lock().release()  # free again


def test_finding_the_commit(tmp_path) -> None:
    st = LocalStorage(str(tmp_path / "none"))
    with pytest.raises(mmapckpt.CheckpointNotFoundError, match="no checkpoint directory"):
        st.find_metadata()
    st = LocalStorage(str(tmp_path))
    _file(tmp_path / "__0_0.distcp", b"x")
    with pytest.raises(mmapckpt.IncompleteCheckpointError, match="did not finish"):
        st.find_metadata()
    _file(tmp_path / ".metadata", b"not metadata")
    assert st.find_metadata() == ".metadata"
    with pytest.raises(mmapckpt.BadMagicError):
        st.read_metadata()
