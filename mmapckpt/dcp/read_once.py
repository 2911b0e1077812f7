"""Read-once planning: which rank reads each stored record that several ranks need.

Runs on the coordinator in ``prepare_global_plan``, which sees every rank's LoadPlan.
Items are grouped by the stored record they read (their ``storage_index``); a record
more than one rank needs is *shared*, and is assigned to exactly one of the ranks
that need it, the one (on the least loaded node, where the ranks said which host they
run on) with the fewest bytes to read so far, biggest records first. Every rank's
plan then carries the same :class:`ReadOnceSchedule` in ``LoadPlan.storage_data``, so
every rank runs the same sequence of collectives in ``read_data`` (see
:mod:`mmapckpt.dcp.deliver`). Records read through stream transforms stay on each
rank's plain path.

The coordinator decides once whether read-once is worth it: where less than
``min_share`` of the bytes the ranks asked for are in shared records (tensor-parallel
shards with a few replicated norms), every plan goes back unchanged and every rank
reads its own items as without read-once.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan

__all__ = ["DEFAULT_MIN_SHARE", "DEFAULT_PIECE_BYTES", "LocalPlanInfo", "ReadOnceOptions", "ReadOnceSchedule",
           "SharedRecord", "local_info", "plan_read_once"]

#: Bytes a shared record travels in between ranks: its pieces are received into a buffer of
#: at most this size (or straight into the target) and never need a second full-size copy.
DEFAULT_PIECE_BYTES = 64 << 20
#: The least share of the requested bytes that must be in records several ranks need for
#: read-once to be used (else every rank reads its own plan, as without read-once).
DEFAULT_MIN_SHARE = 0.25


@dataclass(frozen=True)
class ReadOnceOptions:
    """MmapReader's read-once arguments (see its docstring)."""

    enabled: bool = False
    group: Any = None  # the process group dcp.load runs in; None: the default group
    piece_bytes: int = DEFAULT_PIECE_BYTES
    min_share: float = DEFAULT_MIN_SHARE

    def __post_init__(self) -> None:
        if self.piece_bytes < 1:
            raise ValueError(f"read_once_piece_bytes must be >= 1, got {self.piece_bytes}")
        if not 0.0 <= self.min_share <= 1.0:
            raise ValueError(f"read_once_min_share must be in [0, 1], got {self.min_share}")


@dataclass(frozen=True)
class LocalPlanInfo:
    """What a rank's local plan tells the coordinator (in ``LoadPlan.storage_data``)."""

    host: str


@dataclass(frozen=True)
class SharedRecord:
    """A stored record several ranks need: read by ``reader``, delivered to the other ``ranks``."""

    index: MetadataIndex
    reader: int  # group rank
    ranks: tuple[int, ...]  # group ranks that need it, the reader among them, ascending


@dataclass(frozen=True)
class ReadOnceSchedule:
    """The global schedule every rank follows, in order (the same object in every rank's plan)."""

    records: tuple[SharedRecord, ...]
    world: int
    #: bytes every rank asked for, summed over ranks, and the bytes each rank reads under the schedule
    requested_bytes: int
    reads_per_rank: tuple[int, ...]


def local_info() -> LocalPlanInfo:
    return LocalPlanInfo(host=socket.gethostname())


def plan_read_once(plans: list[LoadPlan], storage_data: dict[MetadataIndex, Any],
                   min_share: float = DEFAULT_MIN_SHARE) -> list[LoadPlan]:
    """Every rank's plan with the read-once schedule in ``storage_data``, or with None there (fall back)."""
    world = len(plans)
    hosts = [p.storage_data.host if isinstance(p.storage_data, LocalPlanInfo) else f"rank{r}"
             for r, p in enumerate(plans)]
    need: dict[MetadataIndex, set[int]] = {}
    for r, plan in enumerate(plans):
        for item in plan.items:
            info = storage_data.get(item.storage_index)
            if info is None or getattr(info, "transform_descriptors", None):
                continue  # the plain path reads it (or says what is wrong)
            need.setdefault(item.storage_index, set()).add(r)
    length = {idx: storage_data[idx].length for idx in need}
    requested = sum(length[idx] * len(ranks) for idx, ranks in need.items())
    shared = {idx: ranks for idx, ranks in need.items() if len(ranks) > 1}
    shared_bytes = sum(length[idx] * len(ranks) for idx, ranks in shared.items())
    if world < 2 or not shared or shared_bytes < min_share * requested:
        return [dataclasses.replace(p, storage_data=None) for p in plans]
    per_rank = [0] * world
    per_host: dict[str, int] = {}
    for idx, ranks in need.items():
        if len(ranks) == 1:
            (r,) = ranks
            per_rank[r] += length[idx]
            per_host[hosts[r]] = per_host.get(hosts[r], 0) + length[idx]
    reader: dict[MetadataIndex, int] = {}
    for idx in sorted(shared, key=lambda i: (-length[i], _order(storage_data, i))):
        r = min(shared[idx], key=lambda q: (per_host.get(hosts[q], 0), per_rank[q], q))
        reader[idx] = r
        per_rank[r] += length[idx]
        per_host[hosts[r]] = per_host.get(hosts[r], 0) + length[idx]
    # Sent in file order, so each reader reads its files front to back.
    records = tuple(SharedRecord(idx, reader[idx], tuple(sorted(shared[idx])))
                    for idx in sorted(shared, key=lambda i: _order(storage_data, i)))
    schedule = ReadOnceSchedule(records, world, requested, tuple(per_rank))
    return [dataclasses.replace(p, storage_data=schedule) for p in plans]


def _order(storage_data: dict[MetadataIndex, Any], idx: MetadataIndex) -> tuple[str, int, str]:
    info = storage_data[idx]
    return (info.relative_path, info.offset, idx.fqn)
