"""Named records: tuples whose fields have names, made without building code when their module is imported.

``typing.NamedTuple`` (``collections.namedtuple`` under it) compiles each class's ``__new__`` from source text
and, under ``from __future__ import annotations``, every field's annotation string on its own: about 0.13 ms a
class in a new process, where the index, layout and read records of a first load are a dozen such classes
(about 10 us a class made this way). A :class:`Record` subclass states its fields twice, checked to agree when the
class is made: as annotations (what type checkers and readers see) and as the parameters of the ``__new__`` it
writes (what builds an instance, as fast as a named tuple's). The base gives the rest of the named-tuple protocol:
``_fields``, ``_field_defaults``, ``_make``, ``_replace``, ``_asdict``, the field accessors, ``__match_args__``, the
repr and pickling. Instances are plain tuples to everything else (equality, hashing, unpacking, indexing).

    class Span(Record):
        __slots__ = ()  # no per-instance dict, as a named tuple's
        start: int
        length: int

        def __new__(cls, start: int, length: int = 0) -> Span:
            return tuple.__new__(cls, (start, length))
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Iterable, TypeVar

try:  # the accessor collections.namedtuple uses (a C descriptor); property(itemgetter) where it is missing
    from _collections import _tuplegetter
except ImportError:  # pragma: no cover - CPython has it
    def _tuplegetter(index: int, doc: str) -> Any:  # type: ignore[misc]
        return property(itemgetter(index), doc=doc)

__all__ = ["Record"]

R = TypeVar("R", bound="Record")


class Record(tuple):  # type: ignore[type-arg]  # each subclass's fields give its items' types
    """The base of a named record (see the module's docstring): subclass it, annotate the fields in order, and
    write ``__new__`` with the same parameters, returning ``tuple.__new__(cls, (field, ...))``."""

    __slots__ = ()
    _fields: tuple[str, ...] = ()
    _field_defaults: dict[str, Any] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fields = tuple(cls.__dict__.get("__annotations__", ()))
        if not fields and "__new__" not in cls.__dict__ and cls._fields:  # a record's subclass adding no fields
            return  # (a named tuple's subclass keeps its fields, as here)
        new = cls.__dict__.get("__new__")
        params: tuple[str, ...] = ()
        if new is not None:
            code = new.__func__.__code__ if isinstance(new, staticmethod) else new.__code__
            params = code.co_varnames[1:code.co_argcount]
        if new is None or params != fields or "__slots__" not in cls.__dict__:
            raise TypeError(f"{cls.__qualname__}: a Record states __slots__ = (), its fields as annotations and a "
                            f"__new__ taking the same parameters in the same order (fields {fields}, __new__ {params})")
        func = new.__func__ if isinstance(new, staticmethod) else new
        defaults = func.__defaults__ or ()
        cls._fields = fields
        cls._field_defaults = dict(zip(fields[len(fields) - len(defaults):], defaults))
        cls.__match_args__ = fields
        for i, name in enumerate(fields):
            setattr(cls, name, _tuplegetter(i, f"Alias for field number {i}"))

    @classmethod
    def _make(cls: type[R], iterable: Iterable[Any]) -> R:
        """An instance from a sequence or iterable of the fields' values, in order."""
        result = tuple.__new__(cls, iterable)
        if len(result) != len(cls._fields):
            raise TypeError(f"{cls.__name__} takes {len(cls._fields)} values, got {len(result)}")
        return result

    def _replace(self: R, **changes: Any) -> R:
        """A copy with the named fields replaced by new values."""
        result = tuple.__new__(type(self), map(changes.pop, self._fields, self))
        if changes:
            raise ValueError(f"{type(self).__name__} has no fields {list(changes)!r}")
        return result

    def _asdict(self) -> dict[str, Any]:
        """The fields by name, in order."""
        return dict(zip(self._fields, self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={v!r}' for n, v in zip(self._fields, self))})"

    def __getnewargs__(self) -> tuple[Any, ...]:
        """Pickling builds the copy through ``__new__`` with the fields as its arguments."""
        return tuple(self)
