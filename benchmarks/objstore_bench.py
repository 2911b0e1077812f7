"""Saves and loads against an object store (s3://, az://, gs://), beside its limits, with the local cache's rows.

``python benchmarks/objstore_bench.py URL [--size 1GB] [--repeats 3] [--out DIR]``, ``URL`` one of
``s3://BUCKET/PREFIX`` (the ``s3`` extra; credentials and endpoint from the ``AWS_*`` environment),
``az://CONTAINER/PREFIX`` (the ``azure`` extra; ``AZURE_STORAGE_CONNECTION_STRING`` or the other
``AZURE_STORAGE_*`` settings) or ``gs://BUCKET/PREFIX`` (the ``gcs`` extra; ``STORAGE_EMULATOR_HOST`` for an
emulator, else Google's default credentials).

One run, one server, the same transformer-shaped state dict throughout, the rows' order
rotating between repetitions. It measures:

- the limits, with the store's own client as mmapckpt configures it: parallel ranged downloads of
  the saved shard object into one preallocated buffer, each response's body read with ``readinto`` from
  the ``http.client`` response beneath urllib3's, straight into the buffer (S3: boto3's ``get_object``;
  Azure: azure-storage-blob's Get Blob operation through its pipeline, body unread; GCS:
  google-cloud-storage's download URL through its authorized session), a sweep of part sizes and
  concurrencies whose best is the GET limit; and parallel uploads of as many bytes from memory (S3: a multipart upload; Azure: staged
  blocks and one block list; GCS: part objects composed into one), a sweep of concurrencies whose
  best is the PUT limit;
- mmapckpt: ``dcp.save`` with MmapWriter, ``load_into`` into preallocated targets, ``dcp.load``
  with MmapReader (default planner and FastLoadPlanner), ``load`` into new tensors;
- the local cache (``storage_options={"cache_dir": ...}``, docs/object-storage.md "The local cache"):
  ``load_into`` through a filled cache beside the same checkpoint loaded from local disk warm (target
  >= 0.9 of it; the local copy saved by the same writer, the two rows timed alternately, five loads of
  each per repetition), through an emptied cache (the fetch into the cache, its check, the load from the
  copy; emptied before the clock starts) beside ``load_into`` without the cache (target >= 0.9), and
  4 processes loading the URL together through one emptied cache: the bytes their clients fetched
  over the checkpoint's size (target 1.0), each process's load checked bitwise;
- DCP's own object-store path, FsspecWriter/FsspecReader over s3fs, adlfs or gcsfs, on the same
  server (the writer with its default single thread and with ``thread_count=4``), where installed;
- peers where they are installed (S3: s3torchconnector's DCP writer/reader); a peer that is not
  installed or fails says why and the run goes on.

Every load is compared bit for bit with the state dict. Each row reports its median time,
GB/s, the fraction of its limit (loads: the GET limit; saves: the PUT limit), and the CPU
seconds per GB of this process (the client) and of the store's processes (radosgw and ceph-osd,
Azurite, gcp-storage-emulator, found in /proc on this machine: loopback only), with the cores each
kept busy, which say which side limits it (on a 2-core machine where both share the cores, their
sum near 2 means the machine's CPU is the limit).
Objects the run writes are under ``PREFIX/mmapckpt-bench-<id>/`` and removed at the end; its local
checkpoint and cache are in a temporary directory under ``--dir``, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from mmapckpt.bench import runner
from mmapckpt.bench.report import write_json
from mmapckpt.bench.synthetic import transformer_state_dict

__all__ = ["run", "main", "store_for"]

PROG = "python benchmarks/objstore_bench.py"

StateDict = dict[str, torch.Tensor]
_GET_SWEEP = ((8 << 20, 8), (16 << 20, 8), (16 << 20, 16), (32 << 20, 16), (64 << 20, 8))
_PUT_SWEEP = ((16 << 20, 2), (16 << 20, 4), (16 << 20, 8))
#: processes loading one URL together through one cache
_TOGETHER = 4
CACHE_WARM, LOCAL_WARM = "load: load_into, cache warm", "load: load_into, local disk warm"
CACHE_COLD, NO_CACHE = "load: load_into, cache cold", "load: mmapckpt.load_into"
TOGETHER = f"load: {_TOGETHER} processes, one URL, cache cold"
#: timed loads of each warm row per repetition (alternating local disk warm and cache warm)
_WARM_TRIALS = 5


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _server_pids(words: tuple[str, ...]) -> list[int]:
    """The object store's processes on this machine, if any: a process named one of ``words`` (radosgw), or a
    node or Python process whose command line names one (Azurite, gcp-storage-emulator)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if comm in words or (comm.startswith(("node", "python")) and any(w in cmd for w in words)):
            out.append(int(d))
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

    def __init__(self, nbytes: int, server: list[int]) -> None:
        self.nbytes = nbytes
        self.rows: dict[str, dict[str, list[float]]] = {}
        self.notes: list[str] = []
        self.correct: dict[str, bool] = {}
        self.fetched: list[float] = []  # the processes loading together: bytes fetched / the checkpoint's bytes
        self.server = server

    def timed(self, row: str, fn: Callable[[], Any]) -> Any:
        c0, s0, t0 = _cpu_self(), _cpu_of(self.server), time.perf_counter()
        out = fn()
        t = time.perf_counter() - t0
        rec = self.rows.setdefault(row, {"s": [], "client_cpu": [], "server_cpu": []})
        rec["s"].append(t)
        rec["client_cpu"].append(_cpu_self() - c0)
        rec["server_cpu"].append(_cpu_of(self.server) - s0)
        return out


# ---------------------------------------------------------------------------- the stores' own clients
def _read_body(raw: Any, mv: memoryview) -> None:
    """Read the body of urllib3's response ``raw`` into ``mv`` with the ``http.client`` response beneath it (the
    socket read into the buffer itself: no chunk objects, no copy), then give the connection back to its pool."""
    from mmapckpt.storage.ranged import _direct_stream
    stream, release = _direct_stream(raw)
    pos, n = 0, len(mv)
    while pos < n:
        got = stream.readinto(mv[pos:])
        if not got:
            raise ConnectionError(f"the body ended after {pos} of {n} bytes")
        pos += got
    release()


def _parallel(threads: int, fn: Callable[[Any], Any], items: Any) -> list[Any]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))


class _S3:
    """S3 through boto3 (mmapckpt's client for the ``AWS_*`` environment)."""

    label, servers = "s3", ("radosgw", "ceph-osd")
    fsspec, peer_hint = "s3fs", "pip install s3fs"
    fsspec_saves = None  # FsspecWriter's saves are measured (None: no reason not to)

    def __init__(self, url: str) -> None:
        from mmapckpt.storage.s3.options import S3Options, client_for, parse_url
        self.bucket, self.prefix = parse_url(url)
        self.client = client_for(S3Options.of(None))

    def objects(self, prefix: str) -> dict[str, int]:
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix + "/"):
            out.update((o["Key"], o["Size"]) for o in page.get("Contents", ()))
        return out

    def get(self, key: str, size: int, part: int, threads: int, buf: memoryview) -> None:
        def one(start: int) -> None:
            n = min(part, size - start)
            r = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + n - 1}")
            _read_body(r["Body"]._raw_stream, buf[start:start + n])
        _parallel(threads, one, range(0, size, part))

    def put(self, key: str, data: memoryview, part: int, threads: int) -> None:
        up = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]

        def one(i: int) -> dict[str, Any]:
            r = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=up, PartNumber=i + 1,
                                        Body=bytes(data[i * part:(i + 1) * part]))
            return {"PartNumber": i + 1, "ETag": r["ETag"]}
        parts = _parallel(threads, one, range(-(-len(data) // part)))
        self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=up,
                                              MultipartUpload={"Parts": parts})

    def remove(self, prefix: str) -> None:
        keys = [{"Key": k} for k in self.objects(prefix)]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[i:i + 1000], "Quiet": True})
        for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket,
                                                                                  Prefix=prefix + "/"):
            for u in page.get("Uploads", ()):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])

    def fsspec_options(self) -> dict[str, Any]:
        return {}


class _Azure:
    """Azure Blob through azure-storage-blob (mmapckpt's ``ContainerClient`` for the ``AZURE_STORAGE_*`` settings)."""

    label, servers = "az", ("azurite-blob", "azurite/dist")
    fsspec, peer_hint = "adlfs", "pip install adlfs"
    fsspec_saves = None

    def __init__(self, url: str) -> None:
        from mmapckpt.storage.azure.options import AzureOptions, client_for, parse_url
        self.bucket, self.prefix, account = parse_url(url)
        self.client = client_for(AzureOptions.of(None, account), self.bucket, url)

    def objects(self, prefix: str) -> dict[str, int]:
        return {b.name: b.size for b in self.client.list_blobs(name_starts_with=prefix + "/")}

    def get(self, key: str, size: int, part: int, threads: int, buf: memoryview) -> None:
        blob = self.client.get_blob_client(key)

        def one(start: int) -> None:
            n = min(part, size - start)
            response = blob._client.blob.download(range=f"bytes={start}-{start + n - 1}", cls=lambda r, _d, _h: r)
            _read_body(response.http_response.internal_response.raw, buf[start:start + n])
        _parallel(threads, one, range(0, size, part))

    def put(self, key: str, data: memoryview, part: int, threads: int) -> None:
        import base64

        from azure.storage.blob import BlobBlock
        blob = self.client.get_blob_client(key)
        ids = [base64.b64encode(f"{i:08d}".encode()).decode() for i in range(-(-len(data) // part))]
        _parallel(threads, lambda i: blob.stage_block(ids[i], bytes(data[i * part:(i + 1) * part])), range(len(ids)))
        blob.commit_block_list([BlobBlock(block_id=b) for b in ids])

    def remove(self, prefix: str) -> None:
        for name in self.objects(prefix):
            try:
                self.client.delete_blob(name)
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass

    def fsspec_options(self) -> dict[str, Any]:
        conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        return {"connection_string": conn} if conn else {}


class _GCS:
    """GCS through google-cloud-storage (mmapckpt's client for the environment)."""

    label, servers = "gs", ("gcp_storage_emulator", "gcp-storage-emulator")
    fsspec, peer_hint = "gcsfs", "pip install gcsfs"
    # gcsfs renames an object (FsspecWriter's .metadata.tmp -> .metadata) with the JSON API's moveTo, which the
    # emulator does not serve (501): gcsfs retries it 6 times with backoff (about 32 s) before it copies and deletes
    # instead, so a save against the emulator measures those retries, not gcsfs
    fsspec_saves = ("not measured on the emulator: gcsfs renames with moveTo, which gcp-storage-emulator lacks (501), "
                    "and retries it for about 32 s a save before copying; the load row reads a stock DCP checkpoint "
                    "saved by FileSystemWriter and uploaded file by file")

    def __init__(self, url: str) -> None:
        from mmapckpt.storage.gcs.options import GCSOptions, client_for, parse_url
        self.bucket, self.prefix = parse_url(url)
        self.client = client_for(GCSOptions.of(None), url)
        self.b = self.client.bucket(self.bucket)

    def objects(self, prefix: str) -> dict[str, int]:
        return {o.name: o.size for o in self.client.list_blobs(self.bucket, prefix=prefix + "/")}

    def get(self, key: str, size: int, part: int, threads: int, buf: memoryview) -> None:
        url = self.b.blob(key)._get_download_url(self.client)

        def one(start: int) -> None:
            n = min(part, size - start)
            response = self.client._http.request("GET", url, headers={"Range": f"bytes={start}-{start + n - 1}"},
                                                 stream=True)
            response.raise_for_status()
            _read_body(response.raw, buf[start:start + n])
        _parallel(threads, one, range(0, size, part))

    def put(self, key: str, data: memoryview, part: int, threads: int) -> None:
        n = -(-len(data) // part)
        names = [f"{key}.part{i:05d}" for i in range(n)]
        _parallel(threads, lambda i: self.b.blob(names[i]).upload_from_string(bytes(data[i * part:(i + 1) * part]),
                                                                            checksum=None), range(n))
        rounds = [names]
        while len(rounds[-1]) > 32:  # a compose takes at most 32 sources
            prev = rounds[-1]
            groups = [prev[i:i + 32] for i in range(0, len(prev), 32)]
            merged = [f"{key}.r{len(rounds)}g{j:03d}" for j in range(len(groups))]
            _parallel(threads, lambda j: self.b.blob(merged[j]).compose([self.b.blob(x) for x in groups[j]]),
                      range(len(groups)))
            rounds.append(merged)
        self.b.blob(key).compose([self.b.blob(x) for x in rounds[-1]])
        for x in (x for r in rounds for x in r):
            self.b.blob(x).delete()

    def remove(self, prefix: str) -> None:
        for name in self.objects(prefix):
            try:
                self.b.blob(name).delete()
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass

    def fsspec_options(self) -> dict[str, Any]:
        host = os.environ.get("STORAGE_EMULATOR_HOST")
        if not host:
            return {}
        return {"endpoint_url": host if "://" in host else f"http://{host}", "token": "anon"}


def store_for(url: str) -> Any:
    """The store of ``url``'s scheme, through its own client (its limits, its listing and removal)."""
    scheme = url.split("://", 1)[0]
    kinds = {"s3": _S3, "az": _Azure, "abfs": _Azure, "gs": _GCS}
    if scheme not in kinds:
        raise SystemExit(f"{PROG}: {url!r}: s3://, az:// or gs:// URLs only")
    return kinds[scheme](url)


# ---------------------------------------------------------------------------- the rows
def _same(a: StateDict, b: StateDict) -> bool:
    return a.keys() <= b.keys() and all(
        torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def _rows(url: str, sd: StateDict, targets: StateDict, store: Any, local: str, cache: str,
          so: dict[str, Any], prefix: str,
          work: str) -> tuple[dict[str, Callable[[], StateDict | None]], dict[str, Callable[[], None]]]:
    """(the rows, what runs untimed before a row's each run); ``so``: the ``storage_options`` of mmapckpt's rows;
    ``prefix``: ``url``'s key prefix in its store; ``work``: a local directory of the run's own."""
    import torch.distributed.checkpoint as dcp

    from mmapckpt.dcp.fast_planner import FastLoadPlanner
    from mmapckpt.dcp.reader import MmapReader
    from mmapckpt.dcp.writer import MmapWriter
    from mmapckpt.into import load_into
    from mmapckpt.lazy import load

    def fresh() -> StateDict:  # zeroed by _one before the clock starts (as the raw GET's buffer is not timed)
        return targets

    cached = {**so, "cache_dir": cache}
    rows: dict[str, Callable[[], StateDict | None]] = {
        "save: dcp.save + MmapWriter": lambda: dcp.save(sd, storage_writer=MmapWriter(f"{url}/mmapckpt", storage_options=so),
                                                       no_dist=True) and None,
        NO_CACHE: lambda: (load_into(fresh(), f"{url}/mmapckpt", storage_options=so), targets)[1],
        "load: dcp.load + MmapReader": lambda: (dcp.load(fresh(), storage_reader=MmapReader(f"{url}/mmapckpt", storage_options=so),
                                                         no_dist=True), targets)[1],
        "load: dcp.load + MmapReader + FastLoadPlanner": lambda: (dcp.load(
            fresh(), storage_reader=MmapReader(f"{url}/mmapckpt", storage_options=so), planner=FastLoadPlanner(),
            no_dist=True),
            targets)[1],
        "load: mmapckpt.load (new tensors)": lambda: load(f"{url}/mmapckpt", storage_options=so),
        LOCAL_WARM: lambda: (load_into(fresh(), local), targets)[1],
        CACHE_WARM: lambda: (load_into(fresh(), f"{url}/mmapckpt", storage_options=cached), targets)[1],
        CACHE_COLD: lambda: (load_into(fresh(), f"{url}/mmapckpt", storage_options=cached), targets)[1],
    }
    before: dict[str, Callable[[], None]] = {
        LOCAL_WARM: lambda: load_into(targets, local),  # its pages in memory
        CACHE_WARM: lambda: load_into(targets, f"{url}/mmapckpt", storage_options=cached),  # the cache filled
        CACHE_COLD: lambda: shutil.rmtree(cache, ignore_errors=True),  # emptied before the clock starts
    }
    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
        if store.label == "gs":
            # gcsfs (since 2025) replaces its file system with one that asks a gRPC endpoint for each bucket's type
            # (zonal or hierarchical buckets); no emulator serves it and the ask hangs a minute a bucket. Its HTTP
            # file system, the one every plain bucket is read through, is the one measured.
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        __import__(store.fsspec)
        opts = store.fsspec_options()
        fsspec_load = f"load: dcp.load + FsspecReader ({store.fsspec})"
        if store.fsspec_saves is None:
            rows[f"save: dcp.save + FsspecWriter ({store.fsspec})"] = lambda: dcp.save(
                sd, storage_writer=FsspecWriter(f"{url}/fsspec", **opts), no_dist=True) and None
            rows[f"save: dcp.save + FsspecWriter ({store.fsspec}, thread_count=4)"] = lambda: dcp.save(
                sd, storage_writer=FsspecWriter(f"{url}/fsspec4", thread_count=4, **opts), no_dist=True) and None
        else:
            rows[f"save: dcp.save + FsspecWriter ({store.fsspec})"] = _missing(store.fsspec_saves)
            before[fsspec_load] = lambda: _upload_stock_dcp(sd, store, f"{prefix}/fsspec", os.path.join(work, "stock"))
        rows[fsspec_load] = lambda: (dcp.load(
            fresh(), storage_reader=FsspecReader(f"{url}/fsspec", **opts), no_dist=True), targets)[1]
    except ImportError as e:
        rows["DCP FsspecWriter/FsspecReader"] = _missing(f"not installed ({e.name}: {store.peer_hint})")
    if store.label == "s3":
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
    return rows, before


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


def _upload_stock_dcp(sd: StateDict, store: Any, prefix: str, local: str) -> None:
    """The stock DCP checkpoint of ``sd`` at ``prefix`` of ``store`` (once): saved by FileSystemWriter into ``local``,
    each file then uploaded through the store's own client (FsspecWriter writes the same files)."""
    if store.objects(prefix):
        return
    import torch.distributed.checkpoint as dcp
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(local), no_dist=True)
    for name in sorted(os.listdir(local)):
        with open(os.path.join(local, name), "rb") as f:
            data = f.read()
        store.put(f"{prefix}/{name}", memoryview(data), 8 << 20, 4)
    shutil.rmtree(local, ignore_errors=True)


def _missing(why: str) -> Callable[[], None]:
    def fn() -> None:
        raise _Skip(why)
    return fn


class _Skip(Exception):
    pass


# ---------------------------------------------------------------------------- processes loading together
_LOADER = textwrap.dedent("""
    import json, os, sys, time, zlib
    import torch
    import mmapckpt
    from mmapckpt.storage.location import register_scheme
    url, cache, go, ready, options = sys.argv[1:6]
    scheme = url.split("://", 1)[0]
    made = []

    def medium(u, options):  # the store's own storage, kept to read its transfer counts after the load
        if scheme == "s3":
            from mmapckpt.storage.s3.storage import S3Storage as Kind
        elif scheme in ("az", "abfs"):
            from mmapckpt.storage.azure.storage import AzureStorage as Kind
        else:
            from mmapckpt.storage.gcs.storage import GCSStorage as Kind
        made.append(Kind(u, options))
        return made[-1]
    register_scheme(scheme, medium)
    open(ready, "w").close()
    while not os.path.exists(go):  # all start together
        time.sleep(0.005)
    t0 = time.perf_counter()
    sd = mmapckpt.load(url, storage_options={**json.loads(options), "cache_dir": cache})
    took = time.perf_counter() - t0
    crc = {k: zlib.crc32(v.contiguous().view(torch.uint8).numpy()) for k, v in sd.items()}
    print(json.dumps({"bytes": sum(s.stats.bytes for s in made), "s": took, "crc": crc}))
""")


def _together(url: str, cache: str, work: str, sd: StateDict, so: dict[str, Any]) -> tuple[float, float, bool]:
    """``_TOGETHER`` processes load ``url`` through the emptied cache ``cache`` at once: (the slowest one's
    seconds, the bytes all fetched, whether each loaded the state dict bitwise)."""
    shutil.rmtree(cache, ignore_errors=True)
    go = os.path.join(work, f"go-{uuid.uuid4().hex[:6]}")
    ready = [f"{go}.ready{i}" for i in range(_TOGETHER)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = [subprocess.Popen([sys.executable, "-c", _LOADER, url, cache, go, r, json.dumps(so)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in ready]
    try:
        deadline = time.monotonic() + 300
        while not all(os.path.exists(r) for r in ready) and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.01)  # every child has imported torch and mmapckpt
        open(go, "w").close()
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError("a loading process failed: " + " | ".join(err[-300:] for _, err in outs if err))
    results = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    want = {k: zlib.crc32(v.contiguous().view(torch.uint8).numpy()) for k, v in sd.items()}
    return max(r["s"] for r in results), sum(r["bytes"] for r in results), all(r["crc"] == want for r in results)


# ---------------------------------------------------------------------------- the run
def run(args: argparse.Namespace, cfg: dict[str, Any], bench_dir: str) -> int:
    """Run the object-store benchmark against ``args.url``; print the table, write the JSON (``bench_dir``: where
    the local checkpoint and the cache go, in a temporary directory removed at the end)."""
    base = args.url.rstrip("/")
    store = store_for(base)
    run_id = uuid.uuid4().hex[:8]
    url = f"{base}/mmapckpt-bench-{run_id}"
    run_prefix = f"{store.prefix}/mmapckpt-bench-{run_id}".lstrip("/")
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    sd = transformer_state_dict(cfg["size"], dtype=cfg["dtype"], layers=cfg["layers"])
    nbytes = sum(t.nbytes for t in sd.values())
    targets = {k: torch.empty_like(v) for k, v in sd.items()}
    run = _Run(nbytes, _server_pids(store.servers))
    work = tempfile.mkdtemp(prefix="objstore-bench-", dir=bench_dir)
    local, cache = os.path.join(work, "local"), os.path.join(work, "cache")
    log(f"state dict: {len(sd)} tensors, {nbytes / 1e9:.3f} GB; {cfg['repeats']} repetition(s) at {url}; "
        f"store processes: {run.server or 'not on this machine'}; load average {os.getloadavg()}")
    so = json.loads(args.storage_options) if args.storage_options else {}
    rows, before = _rows(url, sd, targets, store, local, cache, so, run_prefix, work)
    saves = [r for r in rows if not r.startswith("load")]
    loads = [r for r in rows if r.startswith("load")]
    load_avg = [os.getloadavg()]
    try:
        _save_local(sd, local)
        if args.loads_only:  # the checkpoints the loads read, saved once, untimed
            for name in saves:
                if name == "save: dcp.save + MmapWriter" or (
                        store.fsspec_saves is None and name == f"save: dcp.save + FsspecWriter ({store.fsspec})"):
                    rows[name]()
            saves = []
        for r in range(cfg["repeats"]):
            log(f"repetition {r + 1}/{cfg['repeats']} ...")
            for name in _rotate(saves, r) + _rotate(loads, r):
                if name == CACHE_WARM:
                    continue  # timed with LOCAL_WARM, alternately (_warm_pair)
                if name == LOCAL_WARM:
                    _warm_pair(run, rows, before, sd, targets, first=(r == 0))
                    continue
                _one(run, name, rows[name], before.get(name), sd, targets, first=(r == 0))
            if r == 0:
                _one_together(run, url, cache, work, sd, store, run_prefix, so)
            _limits(run, store, run_prefix, sd, puts=not args.loads_only)
        load_avg.append(os.getloadavg())
        doc = _document(run, cfg, url, load_avg)
        print(_table(doc))
        write_json(args.out, f"bench_{store.label}.json", doc)
    finally:
        log(f"removing {url} ...")
        store.remove(run_prefix)
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(run.correct.values()) else 1


def _save_local(sd: StateDict, local: str) -> None:
    """The local checkpoint of the warm row: saved by the writer that saves the URL's (``dcp.save`` + MmapWriter),
    so that local disk warm and cache warm read the same files, laid out alike."""
    import torch.distributed.checkpoint as dcp

    from mmapckpt.dcp.writer import MmapWriter
    dcp.save(sd, storage_writer=MmapWriter(local), no_dist=True)


def _warm_pair(run: _Run, rows: dict[str, Callable[[], Any]], before: dict[str, Callable[[], None]], sd: StateDict,
               targets: StateDict, first: bool) -> None:
    """The two warm rows, each made warm once untimed, then timed ``_WARM_TRIALS`` times alternately (a warm load
    takes 0.1 s: one sample per repetition is too few on a shared machine)."""
    for name in (LOCAL_WARM, CACHE_WARM):
        if name in run.notes:
            return
        try:
            before[name]()
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            run.notes.append(name)
            run.rows[name] = {"skipped": f"failed: {type(e).__name__}: {e}"[:300]}  # type: ignore[dict-item]
            return
    for k in range(_WARM_TRIALS):
        for name in (LOCAL_WARM, CACHE_WARM)[::1 if k % 2 == 0 else -1]:
            _one(run, name, rows[name], None, sd, targets, first=first and k == 0)


def _rotate(names: list[str], r: int) -> list[str]:
    k = r % max(1, len(names))
    return names[k:] + names[:k]


def _one(run: _Run, name: str, fn: Callable[[], Any], before: Callable[[], None] | None, sd: StateDict,
         targets: StateDict, first: bool) -> None:
    if name in run.notes:
        return
    try:
        if before is not None:
            before()
        if name.startswith("load"):
            for t in targets.values():  # every load fills them again; zeroing them is not the load's time
                t.zero_()
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


def _one_together(run: _Run, url: str, cache: str, work: str, sd: StateDict, store: Any, prefix: str,
                  so: dict[str, Any]) -> None:
    size = sum(store.objects(f"{prefix}/mmapckpt").values())
    try:
        took, fetched, ok = _together(f"{url}/mmapckpt", cache, work, sd, so)
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        run.rows[TOGETHER] = {"skipped": f"failed: {type(e).__name__}: {e}"[:300]}  # type: ignore[dict-item]
        return
    run.rows.setdefault(TOGETHER, {"s": [], "client_cpu": [], "server_cpu": []})["s"].append(took)
    run.rows[TOGETHER]["client_cpu"].append(0.0)  # in the children: not counted here
    run.rows[TOGETHER]["server_cpu"].append(0.0)
    run.fetched.append(fetched / size)
    run.correct[TOGETHER] = ok


def _limits(run: _Run, store: Any, prefix: str, sd: StateDict, *, puts: bool = True) -> None:
    listed = store.objects(f"{prefix}/mmapckpt")
    key = next(k for k in listed if k.endswith(".distcp"))  # its name changes between saves
    size = listed[key]
    buf = memoryview(bytearray(size))
    for part, threads in _GET_SWEEP:
        run.timed(f"limit: GET {part >> 20} MiB x {threads}", lambda: store.get(key, size, part, threads, buf))
    if not puts:
        return
    data = memoryview(bytearray(run.nbytes))
    pos = 0
    for t in sd.values():
        n = t.nbytes
        data[pos:pos + n] = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        pos += n
    for part, threads in _PUT_SWEEP:
        run.timed(f"limit: PUT {part >> 20} MiB x {threads}", lambda: store.put(f"{prefix}/raw-put", data, part,
                                                                              threads))


def _document(run: _Run, cfg: dict[str, Any], url: str, load_avg: list[Any]) -> dict[str, Any]:
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
        if "median_s" not in r or name.startswith("limit") or name in (LOCAL_WARM, CACHE_WARM, TOGETHER):
            continue  # warm loads read no bytes from the store; processes together: no one limit
        limit = best_get if name.startswith("load") else best_put
        if limit is not None:
            r["of_limit"] = r["gb_per_s"] / rows[limit]["gb_per_s"]

    def ratio(a: str, b: str) -> float | None:  # row b's time over row a's: a's speed as a fraction of b's
        return rows[b]["median_s"] / rows[a]["median_s"] if "median_s" in rows.get(a, {}) and "median_s" in \
            rows.get(b, {}) else None
    cache = {"warm_of_local_warm": ratio(CACHE_WARM, LOCAL_WARM), "cold_of_no_cache": ratio(CACHE_COLD, NO_CACHE),
             "fetched_of_size_together": statistics.median(run.fetched) if run.fetched else None,
             "targets": {"warm_of_local_warm": 0.9, "cold_of_no_cache": 0.9, "fetched_of_size_together": 1.0}}
    return {"url": url, "bytes": run.nbytes, "repeats": cfg["repeats"], "cores": os.cpu_count(),
            "load_average": load_avg, "server_pids_found": bool(run.server),
            "limits": {"get": best_get, "put": best_put}, "cache": cache, "correct": run.correct, "rows": rows}


def _table(doc: dict[str, Any]) -> str:
    lines = [f"object store: {doc['url']}  ({doc['bytes'] / 1e9:.3f} GB, medians of {doc['repeats']}; "
             f"limits: {doc['limits']['get']} / {doc['limits']['put']}; load average {doc['load_average']})",
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
    c = doc["cache"]

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"
    lines.append(f"cache: warm / local warm {f(c['warm_of_local_warm'])} (target 0.9); cold / no cache "
                 f"{f(c['cold_of_no_cache'])} (target 0.9); {_TOGETHER} processes together fetched "
                 f"{f(c['fetched_of_size_together'])}x the checkpoint's bytes (target 1.0)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("url", metavar="URL", help="s3://BUCKET/PREFIX, az://CONTAINER/PREFIX or gs://BUCKET/PREFIX "
                                                   "where to save and load (removed at the end)")
    parser.add_argument("--storage-options", default=None, metavar="JSON",
                        help='storage_options of mmapckpt\'s saves and loads, e.g. \'{"require_preconditions": false}\' '
                             "for a GCS emulator")
    parser.add_argument("--loads-only", action="store_true",
                        help="time the loads and the GET limits only (the checkpoints they read saved once, untimed): "
                             "a larger size within the time of a slow store's saves")
    runner.add_common_arguments(parser)
    return runner.drive(parser.parse_args(argv), run, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
