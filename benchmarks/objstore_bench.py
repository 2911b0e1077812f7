"""Saves and loads against an object store, beside its limits.

``python benchmarks/objstore_bench.py s3://BUCKET/PREFIX [--size 1GB] [--repeats 3] [--out DIR]`` (the
``s3`` extra; credentials and endpoint from the ``AWS_*`` environment).

One run, one server, the same transformer-shaped state dict throughout, the rows' order
rotating between repetitions. It measures:

- the limits, with the same client (boto3): parallel ranged GETs of the saved shard object into
  one preallocated buffer, read with ``readinto`` (a sweep of part sizes and concurrencies: the
  best is the GET limit), and a multipart upload of as many bytes from memory (a sweep of
  concurrencies: the best is the PUT limit);
- mmapckpt: ``dcp.save`` with MmapWriter, ``load_into`` into preallocated targets, ``dcp.load``
  with MmapReader (default planner and FastLoadPlanner), ``load`` into new tensors;
- DCP's own object-store path, FsspecWriter/FsspecReader over s3fs, on the same server (the writer
  with its default single thread and with ``thread_count=4``);
- peers where they are installed (s3torchconnector's DCP writer/reader); a peer that is not
  installed or fails says why and the run goes on.

Every load is compared bit for bit with the state dict. Each row reports its median time,
GB/s, the fraction of its limit (loads: the GET limit; saves: the PUT limit), and the CPU
seconds per GB of this process (the client) and of the store's processes (radosgw and
ceph-osd, found in /proc on this machine: loopback only), with the cores each kept busy, which
say which side limits it (on a 2-core machine where both share the cores, their sum near 2 means
the machine's CPU is the limit).
Objects the run writes are under ``PREFIX/mmapckpt-bench-<id>/`` and removed at the end.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from mmapckpt.bench import runner
from mmapckpt.bench.report import write_json
from mmapckpt.bench.synthetic import transformer_state_dict

__all__ = ["run", "main"]

PROG = "python benchmarks/objstore_bench.py"

StateDict = dict[str, torch.Tensor]
_GET_SWEEP = ((8 << 20, 8), (16 << 20, 8), (16 << 20, 16), (32 << 20, 16), (64 << 20, 8))
_PUT_SWEEP = ((16 << 20, 2), (16 << 20, 4), (16 << 20, 8))


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _server_pids() -> list[int]:
    """The object store's processes on this machine (radosgw, ceph-osd), if any."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/comm") as f:
                    if f.read().strip() in ("radosgw", "ceph-osd"):
                        out.append(int(d))
            except OSError:
                pass
    return out


def _cpu_of(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


class _Run:
    """Rows of timings with the client's and the server's CPU seconds."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.rows: dict[str, dict[str, list[float]]] = {}
        self.notes: list[str] = []
        self.correct: dict[str, bool] = {}
        self.server = _server_pids()

    def timed(self, row: str, fn: Callable[[], Any]) -> Any:
        c0, s0, t0 = _cpu_self(), _cpu_of(self.server), time.perf_counter()
        out = fn()
        t = time.perf_counter() - t0
        rec = self.rows.setdefault(row, {"s": [], "client_cpu": [], "server_cpu": []})
        rec["s"].append(t)
        rec["client_cpu"].append(_cpu_self() - c0)
        rec["server_cpu"].append(_cpu_of(self.server) - s0)
        return out


# ---------------------------------------------------------------------------- the limits
def _raw_get(client: Any, bucket: str, key: str, size: int, part: int, threads: int, buf: memoryview) -> None:
    from mmapckpt.storage.s3.reads import _direct_stream

    def one(start: int) -> None:
        n = min(part, size - start)
        r = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + n - 1}")
        stream, release = _direct_stream(r["Body"])
        mv, pos = buf[start:start + n], 0
        while pos < n:
            got = stream.readinto(mv[pos:])
            if not got:
                raise ConnectionError("body ended early")
            pos += got
        release()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(0, size, part)))


def _raw_put(client: Any, bucket: str, key: str, data: memoryview, part: int, threads: int) -> None:
    up = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

    def one(i: int) -> dict[str, Any]:
        r = client.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=i + 1,
                               Body=bytes(data[i * part:(i + 1) * part]))
        return {"PartNumber": i + 1, "ETag": r["ETag"]}
    with ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(one, range(-(-len(data) // part))))
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts})


# ---------------------------------------------------------------------------- the rows
def _same(a: StateDict, b: StateDict) -> bool:
    return a.keys() <= b.keys() and all(
        torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def _rows(url: str, sd: StateDict, targets: StateDict) -> dict[str, Callable[[], StateDict | None]]:
    import torch.distributed.checkpoint as dcp

    from mmapckpt.dcp.fast_planner import FastLoadPlanner
    from mmapckpt.dcp.reader import MmapReader
    from mmapckpt.dcp.writer import MmapWriter
    from mmapckpt.into import load_into
    from mmapckpt.lazy import load

    def fresh() -> StateDict:  # zeroed by _one before the clock starts (as the raw GET's buffer is not timed)
        return targets

    rows: dict[str, Callable[[], StateDict | None]] = {
        "save: dcp.save + MmapWriter": lambda: dcp.save(sd, storage_writer=MmapWriter(f"{url}/mmapckpt"),
                                                       no_dist=True) and None,
        "load: mmapckpt.load_into": lambda: (load_into(fresh(), f"{url}/mmapckpt"), targets)[1],
        "load: dcp.load + MmapReader": lambda: (dcp.load(fresh(), storage_reader=MmapReader(f"{url}/mmapckpt"),
                                                         no_dist=True), targets)[1],
        "load: dcp.load + MmapReader + FastLoadPlanner": lambda: (dcp.load(
            fresh(), storage_reader=MmapReader(f"{url}/mmapckpt"), planner=FastLoadPlanner(), no_dist=True),
            targets)[1],
        "load: mmapckpt.load (new tensors)": lambda: load(f"{url}/mmapckpt"),
    }
    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
        import s3fs  # noqa: F401
        rows["save: dcp.save + FsspecWriter (s3fs)"] = lambda: dcp.save(
            sd, storage_writer=FsspecWriter(f"{url}/fsspec"), no_dist=True) and None
        rows["save: dcp.save + FsspecWriter (s3fs, thread_count=4)"] = lambda: dcp.save(
            sd, storage_writer=FsspecWriter(f"{url}/fsspec4", thread_count=4), no_dist=True) and None
        rows["load: dcp.load + FsspecReader (s3fs)"] = lambda: (dcp.load(
            fresh(), storage_reader=FsspecReader(f"{url}/fsspec"), no_dist=True), targets)[1]
    except ImportError as e:
        rows["DCP FsspecWriter/FsspecReader"] = _missing(f"not installed ({e.name}: pip install s3fs)")
    try:
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
        region = os.environ.get("AWS_REGION", "us-east-1")
        rows["save: dcp.save + s3torchconnector"] = lambda: dcp.save(
            sd, storage_writer=_s3tc(S3StorageWriter(region, f"{url}/s3tc"), region), no_dist=True) and None
        rows["load: dcp.load + s3torchconnector"] = lambda: (dcp.load(
            fresh(), storage_reader=_s3tc(S3StorageReader(region, f"{url}/fsspec"), region), no_dist=True),
            targets)[1]  # the stock DCP checkpoint FsspecWriter saved
    except ImportError as e:
        rows["s3torchconnector"] = _missing(f"not installed ({e.name}: pip install s3torchconnector)")
    return rows


def _s3tc(peer: Any, region: str) -> Any:
    """s3torchconnector's reader or writer, its client pointed at ``AWS_ENDPOINT_URL`` with path-style
    addressing where one is set (its DCP classes take no endpoint)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp.s3_file_system import S3FileSystem
        client = S3Client(region, endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True))
        peer.fs = S3FileSystem(region, s3_client=client)
    return peer


def _missing(why: str) -> Callable[[], None]:
    def fn() -> None:
        raise _Skip(why)
    return fn


class _Skip(Exception):
    pass


# ---------------------------------------------------------------------------- the run
def run(args: argparse.Namespace, cfg: dict[str, Any], bench_dir: str) -> int:
    """Run the object-store benchmark against ``args.url``; print the table, write the JSON (``bench_dir``: unused,
    everything it writes is on the store)."""
    from mmapckpt.storage.s3.options import S3Options, client_for, parse_url

    base = args.url.rstrip("/")
    bucket, prefix = parse_url(base)
    run_id = uuid.uuid4().hex[:8]
    url = f"{base}/mmapckpt-bench-{run_id}"
    run_prefix = f"{prefix}/mmapckpt-bench-{run_id}".lstrip("/")
    client = client_for(S3Options.of(None))
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    sd = transformer_state_dict(cfg["size"], dtype=cfg["dtype"], layers=cfg["layers"])
    nbytes = sum(t.nbytes for t in sd.values())
    targets = {k: torch.empty_like(v) for k, v in sd.items()}
    run = _Run(nbytes)
    log(f"state dict: {len(sd)} tensors, {nbytes / 1e9:.3f} GB; {cfg['repeats']} repetition(s) at {url}; "
        f"store processes: {run.server or 'not on this machine'}")
    rows = _rows(url, sd, targets)
    saves = [r for r in rows if not r.startswith("load")]
    loads = [r for r in rows if r.startswith("load")]
    try:
        for r in range(cfg["repeats"]):
            log(f"repetition {r + 1}/{cfg['repeats']} ...")
            for name in _rotate(saves, r) + _rotate(loads, r):
                _one(run, name, rows[name], sd, targets, first=(r == 0))
            _limits(run, client, bucket, run_prefix, sd)
        doc = _document(run, cfg, url)
        print(_table(doc))
        write_json(args.out, "bench_s3.json", doc)
    finally:
        log(f"removing {url} ...")
        _remove_prefix(client, bucket, run_prefix)
    return 0 if all(run.correct.values()) else 1


def _rotate(names: list[str], r: int) -> list[str]:
    k = r % max(1, len(names))
    return names[k:] + names[:k]


def _one(run: _Run, name: str, fn: Callable[[], Any], sd: StateDict, targets: StateDict, first: bool) -> None:
    if name in run.notes:
        return
    if name.startswith("load"):
        for t in targets.values():  # every load fills them again; zeroing them is not the load's time
            t.zero_()
    try:
        out = run.timed(name, fn)
    except BaseException as e:  # noqa: BLE001 - a peer that is missing or fails is reported, the run goes on
        if isinstance(e, KeyboardInterrupt):
            raise
        cause = next(iter(getattr(e, "failures", {}).values()), e)  # DCP's CheckpointException: the rank's error
        why = str(e) if isinstance(e, _Skip) else f"failed: {type(cause).__name__}: {cause}"[:300]
        run.notes.append(name)  # not run again
        run.rows[name] = {"skipped": why}  # type: ignore[dict-item]
        return
    if first and out is not None:
        run.correct[name] = _same(sd, out)


def _limits(run: _Run, client: Any, bucket: str, prefix: str, sd: StateDict) -> None:
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/mmapckpt/")["Contents"]
    shard = next(o for o in listed if o["Key"].endswith(".distcp"))  # its name changes between saves
    key, size = shard["Key"], shard["Size"]
    buf = memoryview(bytearray(size))
    for part, threads in _GET_SWEEP:
        run.timed(f"limit: GET {part >> 20} MiB x {threads}", lambda: _raw_get(client, bucket, key, size, part,
                                                                              threads, buf))
    data = memoryview(bytearray(run.nbytes))
    pos = 0
    for t in sd.values():
        n = t.nbytes
        data[pos:pos + n] = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        pos += n
    for part, threads in _PUT_SWEEP:
        run.timed(f"limit: PUT {part >> 20} MiB x {threads}", lambda: _raw_put(client, bucket, f"{prefix}/raw-put",
                                                                              data, part, threads))


def _remove_prefix(client: Any, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for u in page.get("Uploads", ()):
            client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])


def _document(run: _Run, cfg: dict[str, Any], url: str) -> dict[str, Any]:
    gb = run.nbytes / 1e9
    rows: dict[str, Any] = {}
    for name, rec in run.rows.items():
        if "skipped" in rec:
            rows[name] = rec
            continue
        med = statistics.median(rec["s"])
        client, server = statistics.median(rec["client_cpu"]), statistics.median(rec["server_cpu"])
        rows[name] = {"median_s": med, "min_s": min(rec["s"]), "max_s": max(rec["s"]), "gb_per_s": gb / med,
                      "client_cpu_s_per_gb": client / gb, "server_cpu_s_per_gb": server / gb,
                      # cores kept busy while the row ran: which side (if either) is near its share of the machine
                      "client_cores": client / med, "server_cores": server / med, "times_s": rec["s"]}
    gets = {n: r for n, r in rows.items() if n.startswith("limit: GET") and "median_s" in r}
    puts = {n: r for n, r in rows.items() if n.startswith("limit: PUT") and "median_s" in r}
    best_get = max(gets, key=lambda n: gets[n]["gb_per_s"]) if gets else None
    best_put = max(puts, key=lambda n: puts[n]["gb_per_s"]) if puts else None
    for name, r in rows.items():
        if "median_s" not in r or name.startswith("limit"):
            continue
        limit = best_get if name.startswith("load") else best_put
        if limit is not None:
            r["of_limit"] = r["gb_per_s"] / rows[limit]["gb_per_s"]
    return {"url": url, "bytes": run.nbytes, "repeats": cfg["repeats"], "cores": os.cpu_count(),
            "server_pids_found": bool(run.server), "limits": {"get": best_get, "put": best_put},
            "correct": run.correct, "rows": rows}


def _table(doc: dict[str, Any]) -> str:
    lines = [f"object store: {doc['url']}  ({doc['bytes'] / 1e9:.3f} GB, medians of {doc['repeats']}; "
             f"limits: {doc['limits']['get']} / {doc['limits']['put']})",
             f"{'row':52} {'median s':>9} {'GB/s':>6} {'of limit':>9} {'client cpu s/GB':>16} {'server cpu s/GB':>16}"
             f" {'cores: client + server':>23}"]
    for name, r in doc["rows"].items():
        if "skipped" in r:
            lines.append(f"{name:52} {r['skipped']}")
            continue
        of = f"{r['of_limit']:.2f}" if "of_limit" in r else "-"
        ok = "" if name not in doc["correct"] else ("  bitwise" if doc["correct"][name] else "  WRONG DATA")
        lines.append(f"{name:52} {r['median_s']:9.3f} {r['gb_per_s']:6.2f} {of:>9} "
                     f"{r['client_cpu_s_per_gb']:16.2f} {r['server_cpu_s_per_gb']:16.2f} "
                     f"{r['client_cores']:11.2f} + {r['server_cores']:.2f}{ok}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("url", metavar="s3://BUCKET/PREFIX", help="where to save and load (removed at the end)")
    runner.add_common_arguments(parser)
    return runner.drive(parser.parse_args(argv), run, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
