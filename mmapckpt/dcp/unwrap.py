"""The typed mmapckpt error behind the exceptions ``dcp.save`` and ``dcp.load`` raise."""

from __future__ import annotations

from ..errors import CheckpointError

__all__ = ["checkpoint_error"]


def checkpoint_error(exc: BaseException, reader: object = None) -> BaseException:
    """The typed error behind an exception that ``dcp.save``/``dcp.load`` raised.

    DCP wraps every rank's error in ``CheckpointException`` (a ``BaseException``) whose
    ``failures`` hold them by rank, sometimes as (exception, traceback) pairs, and turns a
    failed ``read_metadata`` into an ``AssertionError`` that keeps only the message. This
    returns the first rank's :class:`CheckpointError` (the lowest rank that has one, else the
    lowest rank's error); with the ``MmapReader`` passed as ``reader``, the typed error of
    its failed ``read_metadata`` instead of DCP's AssertionError. Anything else comes back as it is.

    Args:
        exc: what ``dcp.save`` or ``dcp.load`` raised.
        reader: the ``MmapReader`` passed to ``dcp.load``, if any.

    Example:
        >>> reader = mmapckpt.MmapReader(path)
        >>> try:
        ...     dcp.load(sd, storage_reader=reader)
        ... except BaseException as e:
        ...     raise mmapckpt.checkpoint_error(e, reader) from e
    """
    failures = getattr(exc, "failures", None)
    err: BaseException = exc
    if isinstance(failures, dict) and failures:
        found = [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]
        typed = [e for e in found if isinstance(e, CheckpointError)]
        err = typed[0] if typed else found[0]
    if isinstance(err, AssertionError):
        stored = getattr(reader, "metadata_error", None)
        if isinstance(stored, CheckpointError):
            return stored
    return err
