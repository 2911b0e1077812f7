"""The targets of ``mmapckpt bench`` (issue 33), evaluated on one run's document.

- cold: ``load_into`` and ``dcp.load`` (MmapReader) >= 0.95 of the best measured disk read
  limit, and each ahead of every peer;
- warm: ``load_into`` and ``dcp.load`` + ``FastLoadPlanner`` >= 0.9 of ``copy_`` into targets;
- mmapckpt's best row ahead of every peer's best row, warm and cold;
- no regression in save (``dcp.save`` + MmapWriter and ``mmapckpt.save`` >= 1.0 of an O_DIRECT
  write+fsync of the same bytes) or in the many-entry scan (its own targets, bench/entries.py).

"Ahead" compares median seconds of the same phase in the same run: the measured figure is the
peer's seconds over mmapckpt's (above 1: mmapckpt is faster). A target whose rows were not run
is listed as not measured, with the reason, never as met.
"""

from __future__ import annotations

from typing import Any

__all__ = ["evaluate", "render", "FRACTIONS", "MMAPCKPT_ROWS", "PEER_FAMILIES", "SUMMARY"]

#: (phase, method, what it is, the limit, the least fraction of it)
FRACTIONS: tuple[tuple[str, str, str, str, float], ...] = (
    ("cold", "mmapckpt-api", "load_into", "disk_best", 0.95),
    ("cold", "mmapckpt", "dcp.load + MmapReader", "disk_best", 0.95),
    ("warm", "mmapckpt-api", "load_into", "copy", 0.9),
    ("warm", "mmapckpt-fast", "dcp.load + FastLoadPlanner", "copy", 0.9),
    ("save", "mmapckpt", "dcp.save + MmapWriter", "write_direct", 1.0),
    ("save", "mmapckpt-api", "mmapckpt.save", "write_direct", 1.0),
)
#: the cold rows held ahead of every peer one by one (the best row is held ahead of them too, warm and cold)
_AHEAD_COLD = (("mmapckpt-api", "load_into"), ("mmapckpt", "dcp.load + MmapReader"))
#: the rows that are mmapckpt's: the best of them is "mmapckpt's best row"
MMAPCKPT_ROWS = ("mmapckpt", "mmapckpt-api", "mmapckpt-fast", "mmapckpt-fast-model", "mmapckpt-base")
#: the peer loaders, each the best of its rows (its settings variants)
PEER_FAMILIES = ("tensorizer", "runai", "fastsafetensors")
_LIMITS = {"disk_best": "the best disk read", "copy": "copy_ into targets", "write_direct": "an O_DIRECT write+fsync"}
SUMMARY = ("cold: load_into and dcp.load >= 0.95 of the best disk read and ahead of every peer; warm: load_into "
           "and dcp.load + FastLoadPlanner >= 0.9 of copy_; mmapckpt's best row ahead of every peer, warm and cold; "
           "save >= 1.0 of an O_DIRECT write; the many-entry scan's targets")


def _median(rows: dict[tuple[str, str], dict[str, Any]], method: str, phase: str) -> float | None:
    r = rows.get((method, phase))
    return r["median_s"] if r else None


def _peer_best(rows: dict[tuple[str, str], dict[str, Any]], family: str, phase: str) -> tuple[str, float] | None:
    """The fastest row of one peer loader in ``phase``: (its key, its median seconds)."""
    found = [(k, r["median_s"]) for (k, p), r in rows.items()
             if p == phase and (k == family or k.startswith(family + "-"))]
    return min(found, key=lambda x: x[1]) if found else None


def _not_measured(peers: dict[str, Any] | None, family: str) -> str:
    failed = (peers or {}).get("failed", {})
    why = next((f"{k}: {v}" for k, v in failed.items() if k == family or k.startswith(family + "-")), None)
    return why or f"{family} was not run (add it to --methods)"


def _ahead(rows: dict[tuple[str, str], dict[str, Any]], peers: dict[str, Any] | None, phase: str, method: str | None,
           what: str) -> list[dict[str, Any]]:
    if method is None:
        return [{"phase": phase, "method": None, "target": f"{phase}: {what} ahead of every peer", "measured": None,
                 "at_least": None, "met": None, "note": "no mmapckpt row was run"}]
    ours = _median(rows, method, phase)
    out = []
    for fam in PEER_FAMILIES:
        t = {"phase": phase, "method": method, "target": f"{phase}: {what} ahead of {fam}", "at_least": 1.0,
             "against": None, "measured": None, "met": None, "note": None}
        best = _peer_best(rows, fam, phase)
        if ours is None:
            t["note"] = f"{method} was not run"
        elif best is None:
            t["note"] = _not_measured(peers, fam)
        else:
            t["against"], t["measured"] = best[0], best[1] / ours
            t["met"] = t["measured"] > 1.0
        out.append(t)
    return out


def evaluate(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of the run, in order: fractions of limits, leads over peers, the scan's."""
    rows = {(r["method"], r["phase"]): r for r in doc["rows"]}
    limits = doc["limits"]
    out: list[dict[str, Any]] = []
    for phase, method, what, limit, least in FRACTIONS:
        t = {"phase": phase, "method": method, "target": f"{phase}: {what} >= {least} of {_LIMITS[limit]}",
             "at_least": least,
             "against": limit, "measured": None, "met": None, "note": None}
        ours, lim = _median(rows, method, phase), limits.get(limit, {}).get("median_s")
        if ours is None:
            t["note"] = f"{method} was not run (add it to --methods)"
        elif lim is None:
            t["note"] = f"the limit {limit} was not measured here"
        else:
            t["measured"] = lim / ours
            t["met"] = t["measured"] >= least
        out.append(t)
    for method, what in _AHEAD_COLD:
        out += _ahead(rows, doc.get("peers"), "cold", method, what)
    for phase in ("warm", "cold"):
        ours = [(m, rows[(m, phase)]["median_s"]) for m in MMAPCKPT_ROWS if (m, phase) in rows]
        best = min(ours, key=lambda x: x[1])[0] if ours else None
        out += _ahead(rows, doc.get("peers"), phase, best, f"mmapckpt's best row ({best})")
    scan = doc.get("scan")
    if scan is None:
        out.append({"phase": "scan", "method": None, "target": "many-entry scan: its targets", "measured": None,
                     "at_least": None, "against": None, "met": None, "note": "not run (--scan-entries 0 or --quick)"})
    else:
        for s in scan["targets"]:
            out.append({"phase": "scan", "method": None, "target": f"scan, {s['case']} {s['tensors']} tensors: "
                        f"{s['target']}", "measured": s["ratio"], "at_most": s["at_most"], "against": None,
                        "met": s["met"], "note": None})
    return out


def render(targets: list[dict[str, Any]], listed: bool) -> list[str]:
    """The targets section: one line a target, or one line counting them."""
    measured = [t for t in targets if t["met"] is not None]
    met = sum(bool(t["met"]) for t in measured)
    missed = [t["target"] for t in measured if not t["met"]]
    unmeasured = len(targets) - len(measured)
    if not listed:
        return ["", f"targets: {met} of {len(measured)} met{' (missed: ' + '; '.join(missed) + ')' if missed else ''}"
                    f"{f', {unmeasured} not measured' if unmeasured else ''}, --targets lists them; they are "
                    f"{SUMMARY}"]
    lines = ["", "mmapckpt against the targets:"]
    for t in targets:
        if t["met"] is None:
            lines.append(f"  {t['target']}: not measured ({t['note']})")
            continue
        bound = f"at most {t['at_most']}" if "at_most" in t else (
            f"above {t['at_least']}" if "ahead" in t["target"] else f"at least {t['at_least']}")
        vs = f" ({t['against']})" if "ahead" in t["target"] else ""
        lines.append(f"  {t['target']}: {t['measured']:.2f}{vs}, {bound}: {'met' if t['met'] else 'MISSED'}")
    return lines
