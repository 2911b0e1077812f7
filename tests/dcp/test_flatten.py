"""flatten.py's one-walk flattening equals DCP's set_up_planner steps, or declines.

Random nested state dicts (with the parts flatten.py declines mixed in: empty dicts,
tuples, int keys, other objects, meta tensors) are set up by the default and the fast
planners; the flat dicts (values compared by identity), the mappings, and what set-up did
to the caller's state dict (which containers were replaced by copies) must be the same.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

import strategies
from mmapckpt import FastLoadPlanner, FastSavePlanner
from mmapckpt.dcp.flatten import flatten_plain, fresh_lists

_KEYS = st.sampled_from(["a", "b", "c.d", "0", ""])
_LEAVES = st.one_of(st.integers(-3, 3), st.booleans(), st.none(), st.text(max_size=2), st.binary(max_size=2),
                    st.floats(allow_nan=False), st.builds(torch.ones, st.integers(0, 3)))
_ODD = st.one_of(st.tuples(st.integers(), st.text(max_size=1)), st.tuples(), st.tuples(st.builds(object)),
                 st.tuples(st.lists(st.integers(), max_size=1)), st.builds(object), st.just(torch.ones(2, device="meta")),
                 st.builds(dict), st.builds(dict, st.dictionaries(st.integers(0, 2), _LEAVES, max_size=1)))


def _trees(odd: bool) -> st.SearchStrategy[Any]:
    leaf = st.one_of(_LEAVES, _ODD) if odd else _LEAVES
    return st.recursive(leaf, lambda kids: st.one_of(st.dictionaries(_KEYS, kids, min_size=1, max_size=3),
                                                     st.lists(kids, max_size=3)), max_leaves=8)


def _state_dicts(odd: bool) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(_KEYS, _trees(odd), min_size=1, max_size=3)


def _layout(obj: Any, before: dict[int, Any]) -> Any:
    """The structure of ``obj``: each container with its type and whether it is the object that
    was at its place before set-up (``before``: id -> object, kept alive), leaves by identity."""
    if type(obj) in (dict, list, tuple):
        kids = obj.items() if type(obj) is dict else enumerate(obj)
        return (type(obj), id(obj) in before, [(k, _layout(v, before)) for k, v in kids])
    return ("leaf", id(obj) if isinstance(obj, torch.Tensor) or type(obj) is object else obj)


def _containers(obj: Any, into: dict[int, Any]) -> dict[int, Any]:
    if type(obj) in (dict, list, tuple):
        into[id(obj)] = obj
        for v in (obj.values() if type(obj) is dict else obj):
            _containers(v, into)
    return into


def _set_up(planner: Any, sd: dict[str, Any]) -> Any:
    before = _containers(sd, {})
    try:
        planner.set_up_planner(sd, None, True)
    except ValueError as e:
        return ("ValueError", str(e))
    flat = {k: ("leaf", id(v)) if isinstance(v, torch.Tensor) or type(v) is object else _layout(v, before)
            for k, v in planner.state_dict.items()}
    return flat, planner.mappings, _layout(sd, before)


def _both(make: Any, default: Any, fast: Any) -> None:
    sd = make()
    # each planner on its own copy of the containers, holding the very same leaves
    memo = {id(v): v for v in _leaves(sd)}
    a, b = copy.deepcopy(sd, dict(memo)), copy.deepcopy(sd, dict(memo))
    assert _set_up(fast, b) == _set_up(default, a)


def _leaves(obj: Any) -> list[Any]:
    if type(obj) in (dict, list, tuple):
        return [x for v in (obj.values() if type(obj) is dict else obj) for x in _leaves(v)]
    return [obj]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_state_dicts(odd=True))
def test_load_set_up_equals_the_default_planners(sd: dict[str, Any]) -> None:
    _both(lambda: sd, DefaultLoadPlanner(), FastLoadPlanner())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_state_dicts(odd=True))
def test_save_set_up_equals_the_default_planners(sd: dict[str, Any]) -> None:
    _both(lambda: sd, DefaultSavePlanner(), FastSavePlanner())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_state_dicts(odd=False))
def test_plain_state_dicts_take_the_one_walk(sd: dict[str, Any]) -> None:
    want = _flatten_sharded_tensors(flatten_state_dict(sd)[0]), flatten_state_dict(sd)[1]
    got = flatten_plain(sd)
    assert got is not None
    assert [(k, id(v)) for k, v in got[0].items()] == [(k, id(v)) for k, v in want[0].items()]
    assert got[1] == want[1]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategies.state_dicts())
def test_the_round_trip_strategies_state_dicts_take_the_one_walk(sd: dict[str, Any]) -> None:
    assert flatten_plain(fresh_lists(copy.copy(sd))) is not None


def test_lists_are_replaced_by_copies_as_init_state_dict_does() -> None:
    names, inner, betas = ["x", "y"], [1, [2]], (0.9, 0.999)
    sd = {"optim": {"param_groups": [{"lr": 0.1, "params": names, "betas": betas}],
                    "nested": [inner, torch.ones(1)]}}
    groups, group = sd["optim"]["param_groups"], sd["optim"]["param_groups"][0]
    planner = FastLoadPlanner()
    planner.set_up_planner(sd, None, True)
    assert sd["optim"]["param_groups"] is not groups and sd["optim"]["param_groups"][0] is group
    assert group["params"] is not names and group["params"] == names
    assert sd["optim"]["nested"][0] is not inner and sd["optim"]["nested"][0] == inner
    assert group["betas"] is not betas and group["betas"] == betas
    assert planner.state_dict["optim.param_groups.0.params"] is group["params"]
    assert planner.state_dict["optim.param_groups.0.betas"] is group["betas"]


def test_the_adam_case_takes_the_one_walk() -> None:
    from mmapckpt.bench.entries import adam_state_dict

    assert flatten_plain(fresh_lists(adam_state_dict(2))) is not None


def test_a_key_twice_raises_as_dcp_does() -> None:
    sd = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        FastSavePlanner().set_up_planner(sd, None, True)
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        FastLoadPlanner().set_up_planner(sd, None, True)


@pytest.mark.parametrize("value", [[(object(),), 1], [([1],)], [(1, "a"), [2]], ((1, [2]),), [[(), None]]],
                         ids=["object-in-tuple-in-list", "list-in-tuple-in-list", "plain", "list-in-tuple", "empty"])
@pytest.mark.parametrize("planners", [(DefaultLoadPlanner, FastLoadPlanner), (DefaultSavePlanner, FastSavePlanner)],
                         ids=["load", "save"])
def test_tuples_in_lists_set_up_as_dcp_does(value: Any, planners: tuple[Any, Any]) -> None:
    _both(lambda: {"a": value, "t": torch.ones(1)}, planners[0](), planners[1]())
