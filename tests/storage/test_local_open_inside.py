"""A local checkpoint's files are opened through its storage, and the file opened is checked, not only its path.

``open_inside`` resolves a name and refuses one that leaves the directory; a link swapped into the path after
that check would be followed by the open. ``LocalStorage.open_file`` checks the descriptor it opened
(``/proc/self/fd``), and every reader opens a directory's files through the storage (reading/located.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

import mmapckpt
from mmapckpt.errors import UnsafePathError
from mmapckpt.storage import storage_for
from mmapckpt.storage import local as local_storage

needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="no /proc/self/fd to ask")


@needs_proc
def test_a_file_swapped_for_a_link_outside_after_the_check_is_refused(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "a.bin").write_bytes(b"inside")
    (tmp_path / "secret").write_bytes(b"outside")
    checked = local_storage.open_inside

    def check_then_swap(directory, rel, **kw):  # the race: the path checked, then a link put in its place
        path = checked(directory, rel, **kw)
        os.unlink(path)
        os.symlink(tmp_path / "secret", path)
        return path

    monkeypatch.setattr(local_storage, "open_inside", check_then_swap)
    with pytest.raises(UnsafePathError, match="outside the checkpoint directory"):
        storage_for(str(ck)).open_file("a.bin")


@needs_proc
def test_a_directory_of_safetensors_files_is_opened_through_its_storage(tmp_path, monkeypatch):
    d = tmp_path / "model"
    d.mkdir()
    save_file({"w": torch.arange(6.0)}, str(d / "model.safetensors"))
    opened = []
    real = local_storage.LocalStorage.open_file

    def spy(self, name):
        opened.append(name)
        return real(self, name)

    monkeypatch.setattr(local_storage.LocalStorage, "open_file", spy)
    with mmapckpt.open(str(d)) as f:
        assert torch.equal(f.get_tensor("w"), torch.arange(6.0))
    assert "model.safetensors" in opened
