"""Chunks held for their whole hash while the changed ones after them are written (writing/dedup.py): whatever
order the file ends up in, every chunk is referenced or written as its bytes say, loads bitwise and verifies."""

from __future__ import annotations

from pathlib import Path

import torch

import mmapckpt
from helpers import assert_bitwise_equal, tensor_bytes
from roots import files_of, make_root, save_step

N = (1 << 18) + 3000  # float32, past the 1 MiB above which chunks are hashed on helper threads


def test_held_unchanged_and_changed_chunks_interleaved_round_trip(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    g = torch.Generator().manual_seed(7)
    s1 = {f"t{i:02d}": torch.randn(N + i, generator=g) for i in range(12)}
    save_step(root, 1, s1)
    s2 = {}
    for i, (k, v) in enumerate(s1.items()):
        if i % 3 == 0:
            s2[k] = v  # unchanged: held, then referenced
        elif i % 3 == 1:
            s2[k] = v.clone()
            s2[k][-1] += 1.0  # its head unchanged: held for its whole hash, then written
        else:
            s2[k] = torch.randn(N + i, generator=g)  # another head: written at once
    save_step(root, 2, s2, reuse=(1,))
    files = files_of(root / "step-2")
    for i, k in enumerate(s2):
        assert files[k].startswith("../step-1/") == (i % 3 == 0), (k, files[k])
    got = mmapckpt.load(root / "step-2")
    for k, v in s2.items():
        assert_bitwise_equal(got[k], v, k)
    assert not mmapckpt.verify_checkpoint(root / "step-2").problems
    save_step(root, 3, s2, reuse=(2,))  # every chunk's hash was recorded, held or written at once
    files3 = files_of(root / "step-3")
    assert all(f.startswith("../") for f in files3.values())
    got3 = mmapckpt.load(root / "step-3")
    for k, v in s2.items():
        assert tensor_bytes(got3[k]) == tensor_bytes(v), k
