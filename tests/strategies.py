"""Hypothesis strategies for random DCP state dicts.

Tensor values are built from raw random bytes viewed as the dtype, so NaN
payloads, signed zeros, infinities and subnormals all occur (bool draws only 0
and 1, the only valid bool bytes). Tensors come plain, as non-contiguous views
(transposes, permutations, steps, broadcasts) and as slices of larger storages.

The dtype list is written out here by hand rather than taken from
``mmapckpt.format`` so that a dtype missing from the format's table shows up as
a failure instead of silently shrinking the test.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st

__all__ = [
    "DTYPE_NAMES",
    "ALL_DTYPES",
    "dtypes",
    "shapes",
    "tensor_from_bytes",
    "tensors",
    "leaf_values",
    "state_dicts",
    "tensor_state_dicts",
    "flatten",
    "fresh_like",
]

#: Every dtype name the issue asks for; those the installed torch lacks are skipped.
DTYPE_NAMES: tuple[str, ...] = (
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "bool", "complex32", "complex64", "complex128",
)

ALL_DTYPES: tuple[torch.dtype, ...] = tuple(
    getattr(torch, n) for n in DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
)

#: Largest element count of a generated tensor (keeps examples small and fast).
MAX_NUMEL = 96


def dtypes() -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(ALL_DTYPES)


@st.composite
def shapes(draw: st.DrawFn, *, max_rank: int = 6, max_numel: int = MAX_NUMEL) -> tuple[int, ...]:
    """Shapes of rank 0..max_rank, zero-size dims included, at most ``max_numel`` elements."""
    rank = draw(st.integers(0, max_rank))
    dims: list[int] = []
    for _ in range(rank):
        left = max_numel // math.prod(dims)
        dims.append(draw(st.integers(1, max(1, min(5, left)))))
    if dims and draw(st.sampled_from([False] * 5 + [True])):  # about one in six has a zero-size dim
        dims[draw(st.integers(0, rank - 1))] = 0
    return tuple(dims)


def tensor_from_bytes(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A fresh tensor of ``dtype``/``shape`` whose bytes are ``raw`` (bool: low bit only)."""
    itemsize = dtype.itemsize
    n = math.prod(shape) * itemsize
    if len(raw) != n:
        raise ValueError(f"need {n} bytes for {shape} {dtype}, got {len(raw)}")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    u8 = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
    if dtype == torch.bool:
        u8 = u8 & 1
    return u8.view(dtype).reshape(shape)


@st.composite
def _raw_tensor(draw: st.DrawFn, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    itemsize = dtype.itemsize
    n = math.prod(shape) * itemsize
    return tensor_from_bytes(draw(st.binary(min_size=n, max_size=n)), dtype, shape)


@st.composite
def tensors(draw: st.DrawFn, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of random bytes: contiguous, a view of a larger storage, or non-contiguous."""
    dtype = dtype if dtype is not None else draw(dtypes())
    kind = draw(st.sampled_from(["contiguous", "slice", "strided", "permuted", "expanded"]))
    if kind == "contiguous":
        return draw(_raw_tensor(dtype, draw(shapes())))
    if kind == "expanded":  # stride-0 dims: the bytes of the broadcast, not of the storage
        shape = draw(shapes(max_rank=4, max_numel=24))
        base = draw(_raw_tensor(dtype, tuple(1 if i % 2 else d for i, d in enumerate(shape))))
        return base.expand(shape)
    # Views: cut a region (with steps) out of a bigger base, then maybe permute its dims.
    shape = draw(shapes(max_rank=5, max_numel=48))
    starts = [draw(st.integers(0, 2)) for _ in shape]
    steps = [draw(st.integers(1, 2)) if kind == "strided" else 1 for _ in shape]
    base_shape = tuple(s + max(0, (d - 1) * k + 1) + draw(st.integers(0, 1))
                       for d, s, k in zip(shape, starts, steps))
    flat = draw(_raw_tensor(dtype, (math.prod(base_shape) + draw(st.integers(0, 3)),)))
    off = flat.numel() - math.prod(base_shape)
    base = flat[off:].view(base_shape) if base_shape else flat[off:].view(())
    view = base[tuple(slice(s, s + d * k, k) for s, d, k in zip(starts, shape, steps))]
    if kind == "permuted" and view.dim() > 1:
        view = view.permute(draw(st.permutations(range(view.dim()))))
    return view


def leaf_values() -> st.SearchStrategy[Any]:
    """Non-tensor values DCP stores as BYTE_IO: ints, strings, finite floats."""
    return st.one_of(
        st.integers(-(2**63), 2**63 - 1),
        st.text(max_size=12),
        st.floats(allow_nan=False),
    )


_KEYS = st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True)  # no "." (DCP's fqn separator)
#: Top-level keys are any text: real state dicts have dotted keys, and names must survive
#: JSON headers with quotes, control characters, non-ASCII and lone surrogates.
_TOP_KEYS = st.one_of(_KEYS, st.text(max_size=10))


def _tree(leaf: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaf,
        lambda kids: st.one_of(
            st.dictionaries(_KEYS, kids, min_size=1, max_size=3),
            st.lists(kids, min_size=1, max_size=3),
        ),
        max_leaves=8,
    )


def state_dicts(*, with_values: bool = True) -> st.SearchStrategy[dict[str, Any]]:
    """Nested dicts/lists of tensors (every dtype and view kind) and plain values.

    Note DCP's rule for lists: a list of plain values is one BYTE_IO value (pickled by
    the planner); lists holding tensors or dicts are traversed into entries.
    """
    leaf = st.one_of(tensors(), leaf_values()) if with_values else tensors()
    return st.dictionaries(_TOP_KEYS, _tree(leaf), min_size=1, max_size=5).filter(_fqns_unique)


def _count_leaves(sd: Any) -> int:
    if isinstance(sd, dict):
        return sum(_count_leaves(v) for v in sd.values())
    if isinstance(sd, list) and not _is_terminal(sd):
        return sum(_count_leaves(v) for v in sd)
    return 1


def _fqns_unique(sd: dict[str, Any]) -> bool:
    """Top-level keys may hold '.', so {"a.b": x, "a": {"b": y}} would give one fqn twice."""
    return len(flatten(sd)) == _count_leaves(sd)


def tensor_state_dicts() -> st.SearchStrategy[dict[str, Any]]:
    """Nested dicts and lists of tensors only: every entry is a TENSOR entry, nothing is pickled."""
    return state_dicts(with_values=False)


def _is_terminal(value: Any) -> bool:
    """DCP's rule (torch.distributed.checkpoint._traverse): a list holding no dict, no
    tensor and no non-terminal list is one value, stored whole as BYTE_IO."""
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    return all(not isinstance(v, (dict, torch.Tensor)) and _is_terminal(v) for v in value)


def flatten(sd: Any, path: tuple[str, ...] = ()) -> dict[str, Any]:
    """``{fqn: leaf}`` as DCP flattens a state dict (the path's keys and list indices joined by '.')."""
    if isinstance(sd, dict):
        items = [(str(k), v) for k, v in sd.items()]
    elif isinstance(sd, list) and path and not _is_terminal(sd):
        items = [(str(i), v) for i, v in enumerate(sd)]
    else:
        return {".".join(path): sd}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(flatten(v, path + (k,)))
    return out


def fresh_like(sd: Any, fill_byte: int = 0) -> Any:
    """Load targets: tensors of the same shape and dtype with every byte ``fill_byte``
    (bool: its low bit), None for plain values. A non-zero fill catches a loader
    that skips a copy when the stored bytes happen to be zero."""
    if isinstance(sd, torch.Tensor):
        t = torch.empty(sd.shape, dtype=sd.dtype)
        if t.numel():
            t.view(-1).view(torch.uint8).fill_(fill_byte & 1 if sd.dtype == torch.bool else fill_byte)
        return t
    if isinstance(sd, dict):
        return {k: fresh_like(v, fill_byte) for k, v in sd.items()}
    if isinstance(sd, list):
        return [fresh_like(v, fill_byte) for v in sd]
    return None


# --------------------------------------------------------------------------- chunk layouts (format/tiling.py)
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@st.composite
def tilings(draw: st.DrawFn, *, max_rank: int = 4, max_dim: int = 6) -> tuple[tuple[int, ...], list[Box]]:
    """(shape, chunks) where the chunks tile the shape exactly: boxes cut recursively in two along
    any dimension (guillotine cuts, so grids and staircases both occur), some empty chunks added."""
    shape = tuple(draw(st.lists(st.integers(0, max_dim), min_size=0, max_size=max_rank)))
    boxes: list[Box] = [((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(0, 12))):
        i = draw(st.integers(0, len(boxes) - 1))
        off, sz = boxes[i]
        cuttable = [d for d in range(len(shape)) if sz[d] > 1]
        if not cuttable:
            continue
        d = draw(st.sampled_from(cuttable))
        at = draw(st.integers(1, sz[d] - 1))
        a_sz = sz[:d] + (at,) + sz[d + 1:]
        b_off, b_sz = off[:d] + (off[d] + at,) + off[d + 1:], sz[:d] + (sz[d] - at,) + sz[d + 1:]
        boxes[i:i + 1] = [(off, a_sz), (b_off, b_sz)]
    if shape and draw(st.booleans()):  # a chunk with nothing in it, somewhere inside the tensor
        d = draw(st.integers(0, len(shape) - 1))
        boxes.append((tuple(draw(st.integers(0, g)) if k == d else 0 for k, g in enumerate(shape)),
                      tuple(0 if k == d else g for k, g in enumerate(shape))))
    return shape, draw(st.permutations(boxes))


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """(shape, chunks): a tiling, often damaged (a chunk moved, resized, dropped, duplicated or added)."""
    shape, boxes = draw(tilings())
    boxes = list(boxes)
    nd = len(shape)
    for _ in range(draw(st.integers(0, 2))):
        how = draw(st.sampled_from(["move", "resize", "drop", "duplicate", "add"]))
        if how == "add" or not boxes:
            off = tuple(draw(st.integers(0, g)) for g in shape)
            boxes.append((off, tuple(draw(st.integers(0, g - o)) for o, g in zip(off, shape))))
            continue
        i = draw(st.integers(0, len(boxes) - 1))
        off, sz = boxes[i]
        if how == "drop":
            del boxes[i]
        elif how == "duplicate":
            boxes.append(boxes[i])
        elif nd:
            d = draw(st.integers(0, nd - 1))
            if how == "move":
                o = draw(st.integers(0, shape[d] - sz[d]))
                boxes[i] = (off[:d] + (o,) + off[d + 1:], sz)
            else:
                s = draw(st.integers(0, shape[d] - off[d]))
                boxes[i] = (off, sz[:d] + (s,) + sz[d + 1:])
    return shape, boxes
