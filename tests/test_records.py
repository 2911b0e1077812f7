"""``records.Record`` keeps the named-tuple protocol that ``typing.NamedTuple`` gave the package's records: the same
fields, defaults, accessors, copies, repr, equality and pickling as a ``collections.namedtuple`` of the same fields."""

from __future__ import annotations

import collections
import pickle

import pytest

from mmapckpt.records import Record


class Span(Record):
    """A test record."""

    __slots__ = ()

    start: int
    length: int
    name: str | None

    def __new__(cls, start: int, length: int = 0, name: str | None = None) -> Span:
        return tuple.__new__(cls, (start, length, name))


Twin = collections.namedtuple("Twin", ("start", "length", "name"), defaults=(0, None))


def test_a_record_behaves_as_the_named_tuple_of_its_fields() -> None:
    s, t = Span(4, name="x"), Twin(4, name="x")
    assert Span._fields == Twin._fields and Span._field_defaults == Twin._field_defaults
    assert Span.__match_args__ == Twin.__match_args__
    assert s == t and hash(s) == hash(t) and tuple(s) == (4, 0, "x")
    assert (s.start, s.length, s.name) == (t.start, t.length, t.name)
    assert s._asdict() == t._asdict()
    assert s._replace(length=8) == t._replace(length=8) and type(s._replace(length=8)) is Span
    assert Span._make([1, 2, None]) == Twin._make([1, 2, None]) and type(Span._make([1, 2, None])) is Span
    assert repr(s) == "Span(start=4, length=0, name='x')" == repr(t).replace("Twin", "Span")
    back = pickle.loads(pickle.dumps(s))
    assert back == s and type(back) is Span
    with pytest.raises(ValueError, match="no fields"):
        s._replace(size=1)
    with pytest.raises(TypeError):
        Span._make([1, 2])
    with pytest.raises(AttributeError):
        s.other = 1  # type: ignore[attr-defined]  # no per-instance dict


def test_a_record_whose_new_disagrees_with_its_fields_is_refused_when_made() -> None:
    with pytest.raises(TypeError, match="same parameters"):
        class Swapped(Record):
            __slots__ = ()
            a: int
            b: int

            def __new__(cls, b: int, a: int) -> Swapped:
                return tuple.__new__(cls, (a, b))
    with pytest.raises(TypeError, match="__slots__"):
        class Unslotted(Record):
            a: int

            def __new__(cls, a: int) -> Unslotted:
                return tuple.__new__(cls, (a,))


def test_a_subclass_adding_no_fields_keeps_its_records() -> None:
    class Named(Span):
        def end(self) -> int:
            return self.start + self.length

    n = Named(2, 3)
    assert n.end() == 5 and Named._fields == Span._fields and n._replace(start=0) == (0, 3, None)
