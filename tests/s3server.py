"""A real S3 server for the tests: a one-node Ceph cluster (1 mon, 1 OSD, 1 radosgw) on 127.0.0.1.

All of its state (config, mon store, the OSD's bluestore on a sparse file, logs, PIDs) lives in one
directory. Needs Debian's `radosgw ceph-mon ceph-osd ceph-common` (Ceph 16.2); `missing_binaries()` says
what is absent. Every wait is bounded: a start that does not come up raises `StartError` with the tail
of the daemons' logs, and `stop()` ends every daemon it started by PID (SIGTERM, then SIGKILL), also
after a start that failed half-way.

    server = RadosGW(tmpdir); server.start()
    try:
        bucket = server.new_bucket()
        server.client().put_object(Bucket=bucket, Key="k", Body=b"v")
    finally:
        server.stop(remove_data=True)

By hand (benchmarks): `python tests/s3server.py start DIR` starts the daemons, records their PIDs in
DIR/pids.json, prints `export AWS_...` lines and leaves them running; `python tests/s3server.py stop DIR`
stops them and removes the stored data (the logs stay).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import IO, Any

ACCESS_KEY = "MMAPCKPTTESTACCESSKEY"
SECRET_KEY = "mmapckpt-test-secret-key-0123456789abcdef"
REGION = "us-east-1"
USER_ID = "mmapckpt-test"
RGW_NAME = "client.rgw.test"
BINARIES = ("monmaptool", "ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph")
PIDS_FILE = "pids.json"

GiB = 1 << 30
MiB = 1 << 20


class StartError(RuntimeError):
    """The cluster did not come up; the message carries the tail of every daemon log."""


def missing_binaries() -> list[str]:
    return [name for name in BINARIES if shutil.which(name) is None]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 25) -> str:
    try:
        data = path.read_bytes()[-64 * 1024:]
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def _with_parent(cmd: list[str]) -> list[str]:
    """`cmd` killed when the process that started it dies without stopping it (SIGKILL, os._exit): util-linux's
    setpriv sets PR_SET_PDEATHSIG and execs it (the PID stays). SIGKILL, not SIGTERM: a daemon told to stop
    while the others die with it can wait for them forever."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", *cmd] if setpriv else cmd


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def pids_using(root: str | os.PathLike[str]) -> list[int]:
    """PIDs of the running processes (zombies aside) started with `root`'s ceph.conf."""
    conf = str(Path(root).resolve() / "ceph.conf")
    return sorted(int(p) for p in os.listdir("/proc")
                  if p.isdigit() and conf in _cmdline(int(p)).split(" ") and _alive(int(p)))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


_CONF = """\
[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{mon_port}]
daemonize = false
public addr = 127.0.0.1
ms bind ipv6 = false
ms bind msgr1 = false
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
keyring = {root}/keyring
run dir = {root}/run
crash dir = {root}/crash
log file = {root}/log/$name.log
pid file = {root}/run/$name.pid
admin socket =
log to stderr = false
err to stderr = true
mon cluster log file = {root}/log/cluster.log
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
paxos propose interval = 0.05
paxos min wait = 0.01
debug rocksdb = 0/0
debug bluefs = 0/0

[mon]
mon data = {root}/mon/$cluster-$id
admin socket = {root}/run/$name.asok

[osd]
osd data = {root}/osd/$cluster-$id
admin socket = {root}/run/$name.asok
osd objectstore = bluestore
bluestore block path = {root}/osd/block
bluestore block create = true
bluestore block size = {block_bytes}
bluestore fsck on mount = false
osd fast shutdown notify mon = false
bluestore fsck on mkfs = false
bdev aio poll ms = 20
bluestore cache autotune = false
bluestore cache size = {cache_bytes}
bluestore rocksdb options = compression=kNoCompression,max_write_buffer_number=2,min_write_buffer_number_to_merge=1,recycle_log_file_num=2,write_buffer_size=33554432,writable_file_max_buffer_size=0,compaction_readahead_size=2097152,max_background_compactions=2,max_total_wal_size=268435456

[{rgw_name}]
admin socket = {root}/run/$name.asok
rgw data = {root}/rgw
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw thread pool size = 64
rgw override bucket index max shards = 1
rgw enable usage log = false
rgw enable ops log = false
rgw gc obj min wait = 0
rgw gc processor period = 10
"""


class RadosGW:
    """One mon, one OSD (bluestore on a sparse file of `block_bytes`), one radosgw, all under `root`.

    `block_bytes` bounds what the cluster can hold; it fills at 95 % of it and deleted objects are
    freed by radosgw's garbage collector some seconds later. The sparse file only takes the disk
    space that is written.
    """

    def __init__(self, root: str | os.PathLike[str], *, block_bytes: int = 8 * GiB,
                 cache_bytes: int = 64 * MiB, rgw_port: int = 0, start_timeout: float = 180.0,
                 stop_timeout: float = 20.0) -> None:
        self.root = Path(root).resolve()
        self.block_bytes = block_bytes
        self.cache_bytes = cache_bytes
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.access_key = ACCESS_KEY
        self.secret_key = SECRET_KEY
        self.region = REGION
        self.conf = self.root / "ceph.conf"
        self.mon_port = 0
        self.rgw_port = rgw_port  # 0: a free one
        self.startup_seconds: float | None = None
        self.timings: list[tuple[str, float]] = []  # (phase, seconds) of the last start
        self._t_last = 0.0
        self._procs: dict[str, subprocess.Popen[bytes]] = {}  # started here: name -> process
        self._pids: dict[str, int] = {}  # recorded in pids.json: name -> pid (also daemons of another process)
        self._outs: list[IO[bytes]] = []
        self._deadline = 0.0
        self._detach = False
        self._bucket_counter = 0

    # --- what a client needs -----------------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region}

    def client(self, **overrides: Any) -> Any:
        """A boto3 S3 client for this server (path-style addressing); `overrides` go to `boto3.client`."""
        import boto3
        from botocore.config import Config

        kwargs: dict[str, Any] = {
            "endpoint_url": self.endpoint_url, "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key, "region_name": self.region,
            "config": Config(s3={"addressing_style": "path"}, connect_timeout=10, read_timeout=120,
                             retries={"total_max_attempts": 1, "mode": "standard"})}  # no retries: errors show
        kwargs.update(overrides)
        return boto3.session.Session().client("s3", **kwargs)

    def new_bucket(self, prefix: str = "test") -> str:
        """Create a bucket with a name not used before on this server; return its name."""
        self._bucket_counter += 1
        name = f"{prefix}-{os.getpid()}-{self._bucket_counter}-{uuid.uuid4().hex[:8]}".lower()[:63]
        self.client().create_bucket(Bucket=name)
        return name

    def empty_and_delete_bucket(self, bucket: str) -> None:
        """Abort its multipart uploads, delete every object in it, then the bucket itself."""
        s3 = self.client()
        for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            for up in page.get("Uploads", []):
                s3.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        s3.delete_bucket(Bucket=bucket)

    def rss(self) -> dict[str, int]:
        """Resident memory of each running daemon, bytes."""
        return {name: rss_bytes(pid) for name, pid in self._pids.items() if _alive(pid)}

    # --- start ----------------------------------------------------------------------------------------
    def start(self, *, detach: bool = False) -> None:
        """Start the cluster, create the S3 user, wait until radosgw serves and warm it up.

        `detach=True` leaves the daemons running after this process exits (the command-line `start`);
        otherwise they are killed if this process dies without calling `stop()`. On any failure the
        daemons started so far are stopped and `StartError` is raised.
        """
        if missing := missing_binaries():
            raise StartError(f"missing Ceph binaries: {', '.join(missing)} "
                             "(apt-get install radosgw ceph-mon ceph-osd ceph-common)")
        if self.root.exists() and any(self.root.iterdir()):
            raise StartError(f"{self.root} is not empty: a cluster needs a fresh directory")
        self._detach = detach
        t0 = time.monotonic()
        self._deadline = t0 + self.start_timeout
        self._t_last = t0
        try:
            self._start()
        except BaseException as exc:
            logs = self.log_tails()
            self.stop()
            if isinstance(exc, StartError):
                raise StartError(f"{exc}\n{logs}") from None
            if isinstance(exc, Exception):
                raise StartError(f"radosgw cluster start failed: {exc!r}\n{logs}") from exc
            raise
        self.startup_seconds = time.monotonic() - t0

    def _start(self) -> None:
        for sub in ("run", "log", "crash", "mon", "osd/ceph-0", "rgw"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.rgw_port = self.rgw_port or free_port()
        self.mon_port = free_port()
        while self.mon_port == self.rgw_port:
            self.mon_port = free_port()
        fsid = str(uuid.uuid4())
        self.conf.write_text(_CONF.format(fsid=fsid, mon_port=self.mon_port, rgw_port=self.rgw_port,
                                          root=self.root, block_bytes=self.block_bytes,
                                          cache_bytes=self.cache_bytes, rgw_name=RGW_NAME))
        monmap = self.root / "monmap"
        self._run(["monmaptool", "--create", "--clobber", "--fsid", fsid,
                   "--addv", "a", f"[v2:127.0.0.1:{self.mon_port}]", str(monmap)], timeout=30)
        self._run(["ceph-mon", "-c", str(self.conf), "--mkfs", "-i", "a", "--monmap", str(monmap)], timeout=60)
        self._mark("mon mkfs")
        self._spawn("mon.a", ["ceph-mon", "-c", str(self.conf), "-f", "-i", "a"])

        osd_uuid = str(uuid.uuid4())
        osd_id = self._ceph("osd", "create", osd_uuid).strip()
        if osd_id != "0":
            raise StartError(f"`ceph osd create` gave id {osd_id!r}, expected 0")
        self._mark("mon up, osd created")
        self._run(["ceph-osd", "-c", str(self.conf), "--mkfs", "-i", "0", "--osd-uuid", osd_uuid], timeout=120)
        self._mark("osd mkfs")
        self._spawn("osd.0", ["ceph-osd", "-c", str(self.conf), "-f", "-i", "0"])
        self._wait_osd_up()
        self._mark("osd up")

        self._spawn(RGW_NAME, ["radosgw", "-c", str(self.conf), "-f", "-n", RGW_NAME])
        self._wait_http()
        self._mark("radosgw serves")
        self._run(["radosgw-admin", "-c", str(self.conf), "user", "create", f"--uid={USER_ID}",
                   f"--display-name={USER_ID}", f"--access-key={self.access_key}",
                   f"--secret-key={self.secret_key}"], timeout=self._left(60))
        self._mark("user created")
        self._warm_up()  # with our user's keys: a foreign server on our port fails here
        self._check_daemons()
        self._mark("warm-up")

    def _mark(self, phase: str) -> None:
        now = time.monotonic()
        self.timings.append((phase, now - self._t_last))
        self._t_last = now

    def _left(self, cap: float) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise StartError(f"radosgw cluster not up within {self.start_timeout:.1f} s")
        return min(cap, left)

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CEPH_")}
        env["CEPH_CONF"] = str(self.conf)
        return env

    def _run(self, cmd: list[str], *, timeout: float) -> str:
        self._check_daemons()
        try:
            proc = subprocess.run(_with_parent(cmd), capture_output=True, timeout=self._left(timeout),
                                  env=self._env(), cwd=self.root, stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired as exc:
            raise StartError(f"`{' '.join(cmd)}` did not finish within {exc.timeout:.1f} s") from None
        if proc.returncode != 0:
            raise StartError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n"
                             f"{proc.stderr.decode('utf-8', 'replace')[-3000:]}")
        return proc.stdout.decode("utf-8", "replace")

    def _ceph(self, *args: str, timeout: float = 45) -> str:
        return self._run(["ceph", "-c", str(self.conf), "--connect-timeout", "30", *args], timeout=timeout)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 (closed in stop)
        self._outs.append(out)
        proc = subprocess.Popen(cmd if self._detach else _with_parent(cmd), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=self._env(), cwd=self.root, start_new_session=True)
        self._procs[name] = proc
        self._pids[name] = proc.pid
        self._write_pids()

    def _write_pids(self) -> None:
        tmp = self.root / f"{PIDS_FILE}.tmp"
        tmp.write_text(json.dumps({"conf": str(self.conf), "endpoint_url": self.endpoint_url,
                                   "pids": self._pids}, indent=1))
        os.replace(tmp, self.root / PIDS_FILE)

    def _check_daemons(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise StartError(f"{name} exited with status {proc.returncode} during start")

    def _wait_osd_up(self) -> None:
        while True:
            dump = json.loads(self._ceph("osd", "dump", "--format=json"))
            if any(o.get("osd") == 0 and o.get("up") == 1 for o in dump.get("osds", [])):
                return
            self._left(1)
            time.sleep(0.25)

    def _wait_http(self) -> None:
        while True:
            self._check_daemons()
            try:
                with urllib.request.urlopen(self.endpoint_url + "/", timeout=self._left(2)) as resp:
                    resp.read()
                return
            except urllib.error.HTTPError:
                return  # any HTTP answer means the frontend serves
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)

    def _warm_up(self) -> None:
        """The first writes create radosgw's data pools (several seconds): do them here, once."""
        from botocore.config import Config

        s3 = self.client(config=Config(s3={"addressing_style": "path"}, connect_timeout=self._left(10),
                                       read_timeout=self._left(60),
                                       retries={"total_max_attempts": 1, "mode": "standard"}))
        bucket = "warm-up"
        s3.create_bucket(Bucket=bucket)
        s3.put_object(Bucket=bucket, Key="warm-up", Body=b"x" * 1024)
        if s3.get_object(Bucket=bucket, Key="warm-up")["Body"].read() != b"x" * 1024:
            raise StartError("warm-up object read back wrong")
        s3.delete_object(Bucket=bucket, Key="warm-up")
        upload = s3.create_multipart_upload(Bucket=bucket, Key="warm-up-mp")
        s3.abort_multipart_upload(Bucket=bucket, Key="warm-up-mp", UploadId=upload["UploadId"])
        s3.delete_bucket(Bucket=bucket)
        self._left(1)

    # --- stop -------------------------------------------------------------------------------------------
    def stop(self, *, remove_data: bool = False) -> None:
        """Stop every daemon (radosgw, then the OSD, then the mon) by PID: SIGTERM, SIGKILL after
        `stop_timeout` seconds. Idempotent. `remove_data` then deletes the stores (the logs stay)."""
        errors = []
        started = bool(self._pids)
        for name in sorted(self._pids, key=_stop_order):
            try:
                self._stop_one(name, self._pids[name])
            except Exception as exc:  # noqa: BLE001 (go on stopping the others, then raise)
                errors.append(f"{name}: {exc!r}")
        self._pids.clear()
        self._procs.clear()
        for out in self._outs:
            out.close()
        self._outs.clear()
        if started:
            self._write_pids()  # now empty: a later `stop DIR` finds nothing to stop
        if remove_data:
            for sub in ("osd", "mon", "rgw"):
                shutil.rmtree(self.root / sub, ignore_errors=True)
        if errors:
            raise RuntimeError("could not stop: " + "; ".join(errors))

    def _stop_one(self, name: str, pid: int) -> None:
        proc = self._procs.get(name)
        if proc is None and str(self.conf) not in _cmdline(pid):
            return  # not ours (anymore): the PID is gone or was reused
        for sig, wait in ((signal.SIGTERM, self.stop_timeout), (signal.SIGKILL, 10.0)):
            if not self._running(name, pid):
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while self._running(name, pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        if self._running(name, pid):
            raise RuntimeError(f"{name} (pid {pid}) still runs after SIGKILL")

    def _running(self, name: str, pid: int) -> bool:
        proc = self._procs.get(name)
        if proc is not None:
            return proc.poll() is None  # also reaps it
        return _alive(pid)

    def log_tails(self, lines: int = 25) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")) if (self.root / "log").is_dir() else []:
            if path.stat().st_size:
                parts.append(f"--- {path.name} (last {lines} lines) ---\n{_tail(path, lines)}")
        return "\n".join(parts)

    @classmethod
    def attach(cls, root: str | os.PathLike[str]) -> RadosGW:
        """The cluster a `start(detach=True)` (the command line) left running in `root`."""
        server = cls(root)
        info = json.loads((server.root / PIDS_FILE).read_text())
        server._pids = {name: int(pid) for name, pid in info["pids"].items()}
        server.rgw_port = int(info["endpoint_url"].rsplit(":", 1)[1])
        return server

    def __enter__(self) -> RadosGW:  # noqa: PYI034
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(remove_data=True)


def _stop_order(name: str) -> int:
    return 0 if name.startswith("client.") else 1 if name.startswith("osd.") else 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A one-node Ceph radosgw (S3) on 127.0.0.1 for benchmarks.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_start = sub.add_parser("start", help="start it in DIR (new or empty); print export lines")
    p_start.add_argument("dir")
    p_start.add_argument("--block-gib", type=float, default=8.0, help="OSD capacity (sparse file), GiB")
    p_start.add_argument("--port", type=int, default=0, help="radosgw's port on 127.0.0.1 (default: a free one)")
    p_stop = sub.add_parser("stop", help="stop the daemons recorded in DIR and remove their data")
    p_stop.add_argument("dir")
    p_stop.add_argument("--keep-data", action="store_true")
    args = parser.parse_args(argv)
    if args.cmd == "start":
        server = RadosGW(args.dir, block_bytes=int(args.block_gib * GiB), rgw_port=args.port)
        server.start(detach=True)
        phases = ", ".join(f"{p} {t:.1f}" for p, t in server.timings)
        print(f"# radosgw up in {server.startup_seconds:.1f} s ({phases}); "
              f"stop it: python {sys.argv[0]} stop {args.dir}", file=sys.stderr)
        for key, value in server.env().items():
            print(f"export {key}={value}")
        return 0
    server = RadosGW.attach(args.dir)
    server.stop(remove_data=not args.keep_data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
