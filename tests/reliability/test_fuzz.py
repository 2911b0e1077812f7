"""Hypothesis-driven mutations of real checkpoints: refused with CheckpointError or loaded bit for bit.

Targets (each mutated copy of a real checkpoint is loaded with ``MmapReader`` and
``dcp.load``):

* shard bytes: bit flips, byte sets, truncations, insertions, deletions and absurd
  u64/u32 values, mostly in the preamble and header, some anywhere (loaded with
  ``verify=True``, so a hit in tensor data must be caught too);
* shard header JSON with a recomputed, valid CRC (so the parser's own checks, not
  the checksum, must refuse it): hostile offsets, lengths, shapes, dtypes, kinds,
  duplicate, overlapping, missing and extra entries (loaded with and without verify);
* ``.metadata`` bytes, and its JSON with a recomputed CRC: hostile sizes, chunks,
  storage records and paths (``..``, absolute);
* a stock DCP checkpoint's pickled ``.metadata`` bytes (restricted unpickler).

Each case must end in a ``CheckpointError`` (for ``dcp.load``: the unwrapped
failure; errors from ``read_metadata`` are checked on ``MmapReader`` directly,
because dcp.load replaces them with an AssertionError carrying their message) or in
a load that is bitwise equal to the original. For metadata JSON mutated with a valid
CRC, and for stock pickled metadata (which has no checksum), one more outcome is
allowed: DCP's planner reporting that the (consistent) metadata describes other keys
or sizes than the target state dict.

The loop runs in a child process under RLIMIT_AS (4 GiB) and a timeout, so a
crash, a hang or an allocation sized by a number in the file fails the test.
``MMAPCKPT_FUZZ_EXAMPLES`` sets the examples per target; every truncation length of
a small shard and of its metadata is tried as well.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from typing import Any, Callable

import pytest
import torch

from helpers import dcp_failure, dcp_load, dcp_save, metadata_with_doc, shard_with_header, tensor_bytes

from mmapckpt import CheckpointError, MmapReader, MmapWriter

TESTS = os.path.dirname(os.path.abspath(__file__))
#: tests/, where helpers.py and strategies.py live (subprocesses put both on sys.path)
TESTS_ROOT = os.path.dirname(TESTS)
EXAMPLES = int(os.environ.get("MMAPCKPT_FUZZ_EXAMPLES", "150"))
AS_LIMIT = 4 << 30

ABSURD_INTS = [-1, -(2**63), 2**31, 2**32 - 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, 0, 1, 63, 64,
               4096, 4097]


# --------------------------------------------------------------------------- the checkpoints
def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    nan = torch.tensor([0x7FC00123, 0xFFC00001, 0x80000000, 0x3F800000], dtype=torch.int64).to(torch.int32)
    return {
        "w": torch.randn(24, 8, generator=g),
        "h": torch.randn(33, generator=g).to(torch.float16),
        "b": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "f8": torch.randint(0, 256, (7,), generator=g, dtype=torch.uint8).view(torch.float8_e5m2),
        "i": torch.randint(-100, 100, (3, 4), generator=g, dtype=torch.int64),
        "nan": nan.view(torch.float32),
        "empty": torch.zeros(0, 4),
        "flag": torch.tensor([True, False]),
        "extra": {"step": 7, "name": "run"},
    }


def tiny_state() -> dict[str, Any]:
    """For truncation at every length: one small file."""
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "n": torch.tensor([-0.0, float("nan")])}


def build(root: str) -> dict[str, str]:
    """mmapckpt checkpoints (2 shard files, 64-byte alignment, and 1 file) and a stock DCP one."""
    import torch.distributed.checkpoint as dcp

    paths = {"mm": os.path.join(root, "mm"), "small": os.path.join(root, "small"), "stock": os.path.join(root, "stock")}
    dcp_save(state(), MmapWriter(paths["mm"], thread_count=2, alignment=64))
    dcp_save(tiny_state(), MmapWriter(paths["small"], alignment=64))
    dcp.save(state(), storage_writer=dcp.FileSystemWriter(paths["stock"]), no_dist=True)
    return paths


# --------------------------------------------------------------------------- the oracle
# DCP's planner refusing a (checksummed, self-consistent) metadata that describes another state dict
# than the targets: a missing key, another size, or another kind of item (the version-2 table can swap
# two names with everything they describe; the shard headers would still refuse the bytes on read).
PLANNER_MISMATCH = ("Missing key in checkpoint state_dict", "Size mismatch", "Invalid checkpoint metadata for")


def _refused(e: CheckpointError) -> str:
    # a MemoryError turned into a CheckpointError means something was allocated by a claimed size
    assert "MemoryError" not in str(e), f"allocation sized by the file: {e}"
    return "refused:" + type(e).__name__


def outcome(d: str, *, verify: bool, allow_planner: bool = False,
            state_fn: Callable[[], dict[str, Any]] | None = None) -> str:
    """Load the checkpoint at ``d``; return how it ended, or raise AssertionError if it ended badly."""
    try:
        MmapReader(d).read_metadata()
    except CheckpointError as e:
        return _refused(e)
    except BaseException as e:
        raise AssertionError(f"read_metadata raised {type(e).__name__}: {e}") from e
    want = (state_fn or state)()
    t = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else {kk: None for kk in v} for k, v in want.items()}
    try:
        dcp_load(t, MmapReader(d, verify=verify))
    except BaseException as e:
        err = dcp_failure(e)
        if isinstance(err, CheckpointError):
            return _refused(err)
        if allow_planner and isinstance(err, (ValueError, RuntimeError)) and any(m in str(err) for m in PLANNER_MISMATCH):
            return "planner-mismatch"
        raise AssertionError(f"dcp.load raised {type(err).__name__}: {err}") from err
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert t[k].dtype == v.dtype and t[k].shape == v.shape, k
            assert tensor_bytes(t[k]) == tensor_bytes(v), f"{k}: loaded bytes differ from the saved ones"
        else:
            assert t[k] == v, f"{k}: {t[k]!r} != {v!r}"
    return "loaded"


class Case:
    """A scratch copy of one checkpoint whose file ``name`` is replaced by mutated bytes."""

    def __init__(self, src: str, scratch: str, state_fn: Callable[[], dict[str, Any]] | None = None) -> None:
        self.src, self.scratch, self.state_fn = src, scratch, state_fn or state
        shutil.copytree(src, scratch)
        self.dirty: str | None = None

    def __call__(self, name: str, data: bytes, **kw: Any) -> str:
        if self.dirty is not None:  # put back the file the previous case replaced
            shutil.copyfile(os.path.join(self.src, self.dirty), os.path.join(self.scratch, self.dirty))
        self.dirty = name
        with open(os.path.join(self.scratch, name), "wb") as f:
            f.write(data)
        return outcome(self.scratch, state_fn=self.state_fn, **kw)


# --------------------------------------------------------------------------- byte mutations
def apply_ops(data: bytes, ops: list[tuple]) -> bytes:
    b = bytearray(data)
    for op in ops:
        kind, pos = op[0], (op[1] % (len(b) + 1)) if b else 0
        if kind == "flip" and pos < len(b):
            b[pos] ^= 1 << op[2]
        elif kind == "set" and pos < len(b):
            b[pos] = op[2]
        elif kind == "truncate":
            del b[pos:]
        elif kind == "insert":
            b[pos:pos] = op[2]
        elif kind == "delete":
            del b[pos:pos + op[2]]
        elif kind == "u64":
            b[pos:pos + 8] = struct.pack("<Q", op[2] % 2**64)
        elif kind == "u32":
            b[pos:pos + 4] = struct.pack("<I", op[2] % 2**32)
    return bytes(b)


def byte_ops(hot: int):
    """Hypothesis strategy of mutation lists; positions favour the first ``hot`` bytes."""
    from hypothesis import strategies as st

    pos = st.one_of(st.integers(0, 40), st.integers(0, hot), st.integers(0, 2**20))
    big = st.one_of(st.sampled_from(ABSURD_INTS), st.integers(0, 2**64 - 1))
    op = st.one_of(
        st.tuples(st.just("flip"), pos, st.integers(0, 7)),
        st.tuples(st.just("set"), pos, st.integers(0, 255)),
        st.tuples(st.just("truncate"), pos),
        st.tuples(st.just("insert"), pos, st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete"), pos, st.integers(1, 64)),
        st.tuples(st.just("u64"), st.sampled_from([16, 24, 28, 20]) | pos, big),
        st.tuples(st.just("u32"), st.sampled_from([24, 28, 8, 10]) | pos, big),
    )
    return st.lists(op, min_size=1, max_size=4)


# --------------------------------------------------------------------------- JSON mutations with a valid CRC
def hostile_value():
    from hypothesis import strategies as st

    ints = st.one_of(st.sampled_from(ABSURD_INTS), st.integers(-(2**70), 2**70))
    scalars = st.one_of(ints, st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=8),
                        st.sampled_from(["float32", "float16", "bfloat16", "int64", "bool", "float8_e5m2",
                                         "complex32", "float128", "tensor", "bytes", "../x", "/etc/passwd",
                                         "__0_0.distcp", "__0_1.distcp", "a/../../b", "00000000", "ffffffff"]))
    return st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=5), st.dictionaries(st.text(max_size=6), c, max_size=3)),
                        max_leaves=8)


def mutate_doc(doc: Any, draw: Callable, hv: Any) -> Any:
    """One structural edit somewhere in a JSON document: replace, delete, duplicate or swap."""
    from hypothesis import strategies as st

    doc = copy.deepcopy(doc)
    containers, stack = [], [doc]
    while stack:  # every dict/list with its keys, to pick one edit site
        c = stack.pop()
        if isinstance(c, dict):
            containers.extend((c, k) for k in c)
            stack.extend(c.values())
        elif isinstance(c, list):
            containers.extend((c, i) for i in range(len(c)))
            stack.extend(c)
    if not containers:
        return draw(hv)
    c, k = draw(st.sampled_from(containers))
    action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "duplicate", "swap", "perturb"]))
    if action == "replace":
        c[k] = draw(hv)
    elif action == "delete":
        del c[k]
    elif action == "duplicate" and isinstance(c, list):
        c.insert(k, copy.deepcopy(c[k]))
    elif action == "swap" and isinstance(c, list) and len(c) > 1:
        j = draw(st.integers(0, len(c) - 1))
        c[k], c[j] = c[j], c[k]
    elif action == "perturb" and type(c[k]) is int:
        c[k] += draw(st.sampled_from([-4096, -64, -1, 1, 63, 64, 4096, 2**32, 2**63]))
    elif action == "perturb" and isinstance(c[k], list) and c[k] and all(type(x) is int for x in c[k]):
        c[k] = c[k][::-1] + draw(st.lists(st.sampled_from([0, 1, 2**31, 2**62]), max_size=2))
    else:
        c[k] = draw(hv)
    return doc


# --------------------------------------------------------------------------- the child
def fuzz_main(root: str, examples: int) -> None:
    import resource
    import warnings

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)
    paths = build(root)
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    cfg = settings(max_examples=examples, deadline=None, database=None, print_blob=True,
                   suppress_health_check=list(HealthCheck))
    counts: dict[str, dict[str, int]] = {}

    def record(target: str, result: str) -> None:
        counts.setdefault(target, {}).setdefault(result, 0)
        counts[target][result] += 1

    mm, stock = paths["mm"], paths["stock"]
    shard_name = "__0_0.distcp"
    shard = open(os.path.join(mm, shard_name), "rb").read()
    meta = open(os.path.join(mm, ".metadata"), "rb").read()
    stock_meta = open(os.path.join(stock, ".metadata"), "rb").read()
    hlen = struct.unpack_from("<Q", shard, 16)[0]
    header_doc = json.loads(shard[32:32 + hlen])
    meta_doc = json.loads(meta[24:])
    case = Case(mm, os.path.join(root, "case"))
    stock_case = Case(stock, os.path.join(root, "stock_case"))

    @cfg
    @given(byte_ops(32 + hlen))
    def shard_bytes(ops):
        record("shard bytes", case(shard_name, apply_ops(shard, ops), verify=True))

    @cfg
    @given(st.data())
    def shard_header_json(data):
        doc = mutate_doc(header_doc, data.draw, hostile_value())
        mutated = shard_with_header(shard, doc)
        r = case(shard_name, mutated, verify=False)
        record("shard header JSON, valid CRC", r)
        if r == "loaded":
            record("shard header JSON, valid CRC, verify=True", outcome(case.scratch, verify=True))

    @cfg
    @given(byte_ops(len(meta)))
    def metadata_bytes(ops):
        record("metadata bytes", case(".metadata", apply_ops(meta, ops), verify=False))

    @cfg
    @given(st.data())
    def metadata_json(data):
        doc = mutate_doc(meta_doc, data.draw, hostile_value())
        record("metadata JSON, valid CRC", case(".metadata", metadata_with_doc(meta, doc), verify=False,
                                                allow_planner=True))

    @cfg
    @given(byte_ops(len(stock_meta)))
    def stock_metadata_bytes(ops):
        # no checksum in the stock format: a flip can leave a valid description of another state dict
        record("stock pickled metadata bytes", stock_case(".metadata", apply_ops(stock_meta, ops), verify=False,
                                                          allow_planner=True))

    for fn in (shard_bytes, shard_header_json, metadata_bytes, metadata_json, stock_metadata_bytes):
        fn()
    # every truncation length of a one-file checkpoint's shard and metadata
    small = Case(paths["small"], os.path.join(root, "small_case"), tiny_state)
    small_shard = open(os.path.join(paths["small"], shard_name), "rb").read()
    small_meta = open(os.path.join(paths["small"], ".metadata"), "rb").read()
    for n in range(len(small_shard)):
        record("shard truncated at every length", small(shard_name, small_shard[:n], verify=False))
    for n in range(len(small_meta)):
        record("metadata truncated at every length", small(".metadata", small_meta[:n], verify=False))
    print(json.dumps({"counts": counts, "shard_size": len(small_shard), "metadata_size": len(small_meta)}))


@pytest.mark.slow
@pytest.mark.timeout(600 + 4 * EXAMPLES)
def test_mutated_checkpoints_are_refused_or_load_bitwise():
    root = tempfile.mkdtemp(prefix="mmapckpt-fuzz-")
    try:
        prog = f"import sys; sys.path[:0] = [{TESTS!r}, {TESTS_ROOT!r}]; import test_fuzz; test_fuzz.fuzz_main(sys.argv[1], int(sys.argv[2]))"
        r = subprocess.run([sys.executable, "-c", prog, root, str(EXAMPLES)], capture_output=True, text=True,
                           timeout=500 + 4 * EXAMPLES)
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
        report = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    counts = report["counts"]
    total = sum(sum(c.values()) for c in counts.values())
    print(f"\n{total} fuzz cases:\n{json.dumps(counts, indent=1, sort_keys=True)}")
    for target in ("shard bytes", "shard header JSON, valid CRC", "metadata bytes", "metadata JSON, valid CRC",
                   "stock pickled metadata bytes"):
        assert sum(counts[target].values()) >= EXAMPLES, (target, counts[target])
        assert any(k.startswith("refused:") for k in counts[target]), (target, counts[target])
    assert sum(counts["shard truncated at every length"].values()) == report["shard_size"]
    # cutting off only the zero padding after the last entry changes nothing that matters
    assert counts["shard truncated at every length"].get("loaded", 0) >= 1
    assert sum(counts["metadata truncated at every length"].values()) == report["metadata_size"]
    assert set(counts["metadata truncated at every length"]) <= {"refused:BadMagicError", "refused:FormatError"}
