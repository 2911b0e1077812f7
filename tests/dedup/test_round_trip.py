"""Unchanged chunks stored once: steps of a managed root refer to their siblings' bytes and load bitwise.

Every step is saved with ``dcp.save`` + ``MmapWriter(reuse=[previous step])`` as CheckpointManager
saves it, and read back through every reader (``open``/``load``, ``load_into``, ``dcp.load`` with
``MmapReader``, ``verify``) bitwise equal to what was saved, NaN payloads and -0.0 included.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmapckpt
from helpers import assert_bitwise_equal, seeded_tensor, tensor_bytes
from mmapckpt.format import layout as fmt
from mmapckpt.reading.shard import Shard
from roots import files_of, frozen_and_trained, make_root, metadata_doc, save_step, shard_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int64,
          torch.bool, torch.complex64]


def _state(step: int, changed: set[str]) -> dict[str, Any]:
    """Tensors of every dtype (seeded: a float one starts with -0.0 and an all-ones NaN), an empty and a 0-d
    tensor; those named in ``changed`` differ from step to step."""
    sd: dict[str, Any] = {}
    for dt in DTYPES:
        name = f"t.{str(dt).split('.')[-1]}"
        sd[name] = seeded_tensor(name + (f"@{step}" if name in changed else ""), (130, 33), dt)
    sd["empty"] = torch.zeros(0, 5)
    sd["scalar"] = torch.tensor(3.5 if "scalar" not in changed else float(step))
    sd["step"] = step
    return sd


def _check_loads(step_dir: Path, sd: dict[str, Any]) -> None:
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    got = mmapckpt.load(step_dir)
    for k, v in tensors.items():
        assert_bitwise_equal(got[k], v, f"load {k}")
    with mmapckpt.open(step_dir, verify=True) as f:
        for k, v in tensors.items():
            assert_bitwise_equal(f.get_tensor(k), v, f"open {k}")
    into = {k: torch.empty_like(v) for k, v in tensors.items()}
    mmapckpt.load_into(into, step_dir)
    for k, v in tensors.items():
        assert_bitwise_equal(into[k], v, f"load_into {k}")
    targets = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}
    dcp.load(targets, storage_reader=mmapckpt.MmapReader(step_dir, verify=True), no_dist=True)
    for k, v in tensors.items():
        assert_bitwise_equal(targets[k], v, f"dcp.load {k}")
    assert targets["step"] == sd["step"]
    report = mmapckpt.verify_checkpoint(step_dir)
    assert not report.problems and not report.notes, report
    mmapckpt.inspect_checkpoint(step_dir)
    out = step_dir.parent.parent / f"{step_dir.name}.safetensors"
    mmapckpt.convert(step_dir, out)  # a copy that stands alone, read through the references
    converted = mmapckpt.load(out)
    for k, v in tensors.items():
        if v.dtype != torch.complex64:  # safetensors has no complex dtype
            assert_bitwise_equal(converted[k], v, f"convert {k}")


def test_unchanged_chunks_are_referenced_and_load_bitwise(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    s1 = _state(1, set())
    save_step(root, 1, s1)
    changed = {"t.bfloat16", "scalar"}
    s2 = _state(2, changed)
    save_step(root, 2, s2, reuse=(1,))
    files = files_of(root / "step-2")
    for k, f in files.items():
        if k in changed or k == "empty":  # empty: no bytes to refer to
            assert not f.startswith("../"), (k, f)
        else:
            assert f == "../step-1/__0_0.distcp", (k, f)
    assert shard_bytes(root / "step-2") < shard_bytes(root / "step-1") / 3
    refs = metadata_doc(root / "step-2")["storage_meta"]["references"]
    assert refs == {"../step-1/__0_0.distcp": metadata_doc(root / "step-1")["storage_meta"]["save_id"]}
    _check_loads(root / "step-1", s1)
    _check_loads(root / "step-2", s2)


def test_a_later_step_refers_to_the_file_holding_the_bytes_not_to_a_reference(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    sds = [_state(s, {"t.float32"}) for s in (1, 2, 3)]
    save_step(root, 1, sds[0])
    save_step(root, 2, sds[1], reuse=(1,))
    save_step(root, 3, sds[2], reuse=(2,))
    files = files_of(root / "step-3")
    assert files["t.int64"] == "../step-1/__0_0.distcp"  # unchanged since step 1: no chain through step 2
    assert not files["t.float32"].startswith("../")
    assert set(metadata_doc(root / "step-3")["storage_meta"]["references"]) == {"../step-1/__0_0.distcp"}
    _check_loads(root / "step-3", sds[2])


def test_a_chunk_that_changed_is_written_even_where_its_shape_and_name_stay(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    a = {"w": torch.arange(4096, dtype=torch.float32)}
    save_step(root, 1, a)
    b = {"w": a["w"].clone()}
    b["w"][4095] = -0.0  # one element of one chunk: another hash
    save_step(root, 2, b, reuse=(1,))
    assert files_of(root / "step-2")["w"] == "__0_0.distcp"
    assert_bitwise_equal(mmapckpt.load(root / "step-2")["w"], b["w"])


def test_every_step_of_an_object_store_root_records_hashes_and_saves_outside_a_root_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = make_root(tmp_path / "local")
    sd = frozen_and_trained()
    save_step(local, 1, sd)  # a local root's first step: hashed, as on every medium
    assert set(Shard(str(local / "step-1" / "__0_0.distcp")).hashes()) == {
        ("frozen.w", (0, 0)), ("frozen.b", (0,)), ("head.w", (0, 0))}
    later = dict(sd, **{"head.w": sd["head.w"] + 1})
    save_step(local, 2, later, reuse=(1,))  # what a later step writes there: CRC-32s alone (compared when needed)
    assert Shard(str(local / "step-2" / "__0_0.distcp")).hashes() == {}
    root = make_root(tmp_path / "root")
    from mmapckpt.dcp import reuse
    monkeypatch.setattr(reuse, "_reads_cheaply", lambda storage: False)  # as on an object store (and before)
    save_step(root, 1, sd)  # no reuse: the first step of a root still records hashes for the next
    shard = Shard(str(root / "step-1" / "__0_0.distcp"))
    hashes = shard.hashes()
    assert set(hashes) == {("frozen.w", (0, 0)), ("frozen.b", (0,)), ("head.w", (0, 0))}
    assert shard.header.minor == fmt.FORMAT_MINOR_HASHES
    blake3 = pytest.importorskip("blake3")
    e = shard.entry("frozen.w", (0, 0))
    data = shard.raw(e).numpy()
    assert hashes[("frozen.w", (0, 0))] == (blake3.blake3(data).hexdigest(), e.offset,
                                            zlib.crc32(data[:fmt.HEAD_BYTES]))
    plain = tmp_path / "plain"
    dcp.save(sd, storage_writer=mmapckpt.MmapWriter(plain), no_dist=True)
    assert b"blake3" not in (plain / "__0_0.distcp").read_bytes()[:4096]
    assert Shard(str(plain / "__0_0.distcp")).header.minor == fmt.FORMAT_MINOR


def test_a_shard_whose_every_chunk_is_referenced_is_not_written(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    sd = {"a": torch.randn(1000), "b": torch.randn(3000)}
    save_step(root, 1, sd, thread_count=2)
    w = save_step(root, 2, dict(sd), reuse=(1,), thread_count=2)
    assert w.write_paths == {} and not list((root / "step-2").glob("*.distcp"))
    got = mmapckpt.load(root / "step-2")
    for k in sd:
        assert_bitwise_equal(got[k], sd[k], k)


def test_a_tensor_saved_under_two_names_is_referenced_under_both(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    emb = torch.randn(100, 16)
    s1 = {"embed.weight": emb, "lm_head.weight": emb, "x": torch.randn(10)}
    save_step(root, 1, s1)
    s2 = {"embed.weight": emb, "lm_head.weight": emb, "x": torch.randn(10)}
    save_step(root, 2, s2, reuse=(1,))
    files = files_of(root / "step-2")
    assert files["embed.weight"] == files["lm_head.weight"] == "../step-1/__0_0.distcp"
    got = mmapckpt.load(root / "step-2")
    assert_bitwise_equal(got["lm_head.weight"], emb)
    assert_bitwise_equal(got["embed.weight"], emb)
    assert not mmapckpt.verify_checkpoint(root / "step-2").problems


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(1, 40), st.booleans()), min_size=1, max_size=6),
       st.integers(0, 2**31))
def test_any_mix_of_changed_and_unchanged_chunks_round_trips(tmp_path_factory: pytest.TempPathFactory,
                                                              specs: list[tuple[torch.dtype, int, bool]],
                                                              seed: int) -> None:
    root = make_root(tmp_path_factory.mktemp("prop") / "root")
    s1 = {f"t{i}": seeded_tensor(f"{seed}-{i}", (n, 3), dt) for i, (dt, n, _) in enumerate(specs)}
    s1["empty"] = torch.zeros(0, 3, dtype=specs[0][0])
    specs = [*specs, (specs[0][0], 0, False)]
    save_step(root, 1, s1)
    s2 = {k: seeded_tensor(f"{seed}-{k}-new", tuple(v.shape), v.dtype) if specs[i][2] else v
          for i, (k, v) in enumerate(s1.items())}
    save_step(root, 2, s2, reuse=(1,))
    files = files_of(root / "step-2")
    for i, (k, v) in enumerate(s2.items()):
        same = tensor_bytes(v) == tensor_bytes(s1[k])
        assert files[k].startswith("../") == (v.numel() > 0 and same), (k, files[k])
    got = mmapckpt.load(root / "step-2")
    for k, v in s2.items():
        assert_bitwise_equal(got[k], v, k)
    assert not mmapckpt.verify_checkpoint(root / "step-2").problems
    json.dumps(metadata_doc(root / "step-2"))  # the commit is plain JSON


def test_a_chunk_whose_head_is_unchanged_is_still_compared_whole(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    n = (1 << 18) + 1000  # float32: past the 64 KiB head whose CRC-32 is compared first
    a = {"w": torch.arange(n, dtype=torch.float32)}
    save_step(root, 1, a)
    b = {"w": a["w"].clone()}
    b["w"][-1] = 7.0  # the head unchanged: only the whole hash can tell
    save_step(root, 2, b, reuse=(1,))
    assert files_of(root / "step-2")["w"] == "__0_0.distcp"
    assert_bitwise_equal(mmapckpt.load(root / "step-2")["w"], b["w"])


def test_a_chunk_written_at_once_still_records_its_hash_for_the_next_step(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    a, b = {"w": torch.randn(1 << 19)}, {"w": torch.randn(1 << 19)}
    save_step(root, 1, a)
    save_step(root, 2, b, reuse=(1,))  # another head: written without waiting for its hash
    save_step(root, 3, b, reuse=(2,))
    assert files_of(root / "step-3")["w"] == "../step-2/__0_0.distcp"
    assert_bitwise_equal(mmapckpt.load(root / "step-3")["w"], b["w"])
