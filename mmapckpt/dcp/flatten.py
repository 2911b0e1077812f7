"""DCP's flattening of a nested state dict in one walk, for the state dicts made of plain parts.

``DefaultLoadPlanner.set_up_planner`` walks a nested state dict three times, calling
closures for every leaf: ``_init_state_dict`` (meta tensors made real, every list and
tuple replaced by a copy), ``_flatten_sharded_tensors`` (the nesting rebuilt with
``set_element`` leaf by leaf) and ``flatten_state_dict``: about 7 us an entry of the Adam
case, more than the rest of the fast load planning. ``DefaultSavePlanner.set_up_planner``
runs the last two. For a state dict built only of non-empty dicts with str keys, lists,
tuples of plain values and leaves of the plain kinds below, :func:`flatten_plain` gives
the same flat dict and mappings (and :func:`fresh_lists` makes the same copies) in one
walk; for anything else (ShardedTensors, meta tensors, other mappings or objects, empty
dicts, tuples holding more than plain values) it returns None and the planner runs DCP's
code, which stays the definition.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["flatten_plain", "fresh_lists"]

#: Leaves whose handling in DCP's three walks is only "keep it" (non-meta tensors too).
_SCALARS = frozenset({str, int, float, bool, type(None), bytes})
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter, DTensor})
_CONTAINERS = frozenset({dict, list, tuple})


class _Unusual(Exception):
    """Something DCP's own walks must handle."""


def fresh_lists(obj: Any) -> Any:
    """What ``_init_state_dict`` does to containers: every list and tuple replaced, in its dict, by a
    copy (made the same way, recursively); dicts kept and changed in place. Other values are kept."""
    t = type(obj)
    if t is dict:
        for k, v in obj.items():
            if type(v) in _CONTAINERS:
                obj[k] = fresh_lists(v)
        return obj
    if t is list or t is tuple:
        copied = [fresh_lists(v) if type(v) in _CONTAINERS else v for v in obj]
        return copied if t is list else tuple(copied)
    return obj


def flatten_plain(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]] | None:
    """``flatten_state_dict(_flatten_sharded_tensors(state_dict))``: the flat dict and the mappings,
    or None where ``state_dict`` holds anything but the plain parts this module describes.

    Raises:
        ValueError: two paths flatten to the same key, as DCP's ``flatten_state_dict`` raises.
    """
    flat: dict[str, Any] = {}
    mappings: dict[str, tuple[Any, ...]] = {}
    try:
        for key, value in state_dict.items():
            if type(key) is not str:
                raise _Unusual
            _walk((key,), key, value, flat, mappings)
    except _Unusual:
        return None
    return flat, mappings


def _walk(path: tuple[Any, ...], fqn: str, value: Any, flat: dict[str, Any], mappings: dict[str, Any]) -> None:
    """traverse_state_dict's visit of ``value`` at ``path``, with flatten_state_dict's visitor."""
    t = type(value)
    if t is dict:
        if not value:  # no leaf: the rebuilt nesting would lose it (a None where it sat in a list)
            raise _Unusual
        for k, v in value.items():
            if type(k) is not str:
                raise _Unusual
            _walk(path + (k,), f"{fqn}.{k}", v, flat, mappings)
        return
    if t is list and not _terminal(value):
        for i, v in enumerate(value):
            _walk(path + (i,), f"{fqn}.{i}", v, flat, mappings)
        return
    if t in _TENSORS:
        if value.is_meta:
            raise _Unusual
    elif t is tuple:
        _check_tuple(value)
    elif t not in _SCALARS and t is not list:
        raise _Unusual
    if fqn in flat:
        raise ValueError(f"duplicated flatten key {fqn}")
    flat[fqn] = value
    mappings[fqn] = path


def _terminal(values: list[Any]) -> bool:
    """traverse_state_dict's ``_is_terminal`` for a list whose every element is plain (else _Unusual):
    no tensor in it, and no dict or non-terminal list."""
    for v in values:
        t = type(v)
        if t in _TENSORS or t is dict:
            return False
        if t is list:
            if not _terminal(v):
                return False
        elif t is tuple:
            _check_tuple(v)
        elif t not in _SCALARS:
            raise _Unusual  # _init_state_dict would make it None; leave that to DCP
    return True


def _check_tuple(values: tuple[Any, ...]) -> None:
    """A tuple is a leaf (``betas=(0.9, 0.999)``); one of plain values only takes the one walk."""
    for v in values:
        if type(v) not in _SCALARS:
            raise _Unusual
