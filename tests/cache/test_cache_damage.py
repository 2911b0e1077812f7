"""Damaged cache entries are found and fetched again, never served: a flipped bit (also with the mtime put back),
a truncated copy, a fetch killed half way (SIGKILL), and bytes that fail their CRC-32 on arrival (never cached)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from s3_data import GetCounter, assert_same, state_dict

import mmapckpt
from mmapckpt.errors import ChecksumError
from mmapckpt.storage.cache import entry
from mmapckpt.storage.cache.entry import RECORD, Entry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sd(salt: int) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state_dict(salt=salt).items() if v.numel()}


def _shard(url: str, cache: str) -> Entry:
    return Entry(cache, f"{url}/__0_0.distcp")


@pytest.mark.parametrize("damage", ["flip", "flip-mtime-kept", "truncate"])
def test_a_damaged_copy_is_fetched_again(env, bucket, cache, damage):
    sd, url, opts = _sd(1), f"s3://{bucket}/ck", {"cache_dir": cache}
    mmapckpt.save(sd, url)
    assert_same(mmapckpt.load(url, storage_options=opts), sd, "first: ")
    shard = _shard(url, cache)
    st = os.stat(shard.data)
    if damage == "truncate":
        os.truncate(shard.data, st.st_size - 4096)
    else:
        with open(shard.data, "r+b") as f:
            f.seek(st.st_size // 2)
            b = f.read(1)
            f.seek(st.st_size // 2)
            f.write(bytes([b[0] ^ 1]))
        if damage == "flip-mtime-kept":
            os.utime(shard.data, ns=(st.st_atime_ns, st.st_mtime_ns))  # only the ctime tells now
    with GetCounter() as again:
        assert_same(mmapckpt.load(url, storage_options=opts), sd, f"after {damage}: ")
    assert again.bytes >= st.st_size  # the shard fetched again
    assert os.stat(shard.data).st_ino != st.st_ino


_KILLED_CHILD = textwrap.dedent("""
    import os, signal, sys
    from mmapckpt.storage.s3 import reads
    real = reads.ObjectReads.read
    def read(self, fetches, entry=None, request_bytes=None):  # the shard's bulk read: half of it, then killed
        offset, buf = fetches[0]
        mv = memoryview(buf).cast("B")
        if len(mv) > 1 << 20:
            real(self, [(offset, mv[:len(mv) // 2])], entry, request_bytes)
            os.kill(os.getpid(), signal.SIGKILL)
        real(self, fetches, entry, request_bytes)
    reads.ObjectReads.read = read
    import mmapckpt
    mmapckpt.load(sys.argv[1], storage_options={"cache_dir": sys.argv[2]})
    print("not killed")
""")


def test_a_fetch_killed_half_way_is_never_served(env, bucket, cache):
    sd, url, opts = _sd(2), f"s3://{bucket}/ck", {"cache_dir": cache}
    mmapckpt.save(sd, url)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, url, cache], env={**os.environ, "PYTHONPATH": ROOT},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, out
    shard = _shard(url, cache)
    left = os.listdir(shard.dir)
    assert any(".tmp-" in n for n in left) and RECORD not in left and os.path.basename(shard.data) not in left
    with GetCounter() as again:
        assert_same(mmapckpt.load(url, storage_options=opts), sd, "after the killed fetch: ")
    assert again.bytes >= os.path.getsize(shard.data)
    assert not any(".tmp-" in n for n in os.listdir(shard.dir))  # the leftover removed by the next fetch


@pytest.mark.parametrize("window", [None, (1 << 20) + 7])
def test_bytes_failing_their_crc_on_arrival_are_never_cached(env, bucket, cache, s3_server, tmp_path, monkeypatch,
                                                             window):
    if window is not None:  # entries split across windows: each CRC-32 carried from window to window
        monkeypatch.setattr(entry, "_WINDOW", window)
    sd, local = _sd(3), tmp_path / "local"
    mmapckpt.save(sd, local)
    good = f"s3://{bucket}/good"
    mmapckpt.save(sd, good)
    assert_same(mmapckpt.load(good, storage_options={"cache_dir": cache}), sd, "intact: ")
    assert Entry(cache, f"{good}/__0_0.distcp").read_record()["check"] == "crc32"
    data = bytearray((local / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x10  # a bit of the 12 MiB entry
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="bad/.metadata", Body=(local / ".metadata").read_bytes())
    client.put_object(Bucket=bucket, Key="bad/__0_0.distcp", Body=bytes(data))
    url = f"s3://{bucket}/bad"
    for _ in range(2):
        with pytest.raises(ChecksumError, match="not cached"):
            mmapckpt.load(url, storage_options={"cache_dir": cache})
        shard = _shard(url, cache)
        assert sorted(os.listdir(shard.dir)) == ["#lock"]


def test_a_copy_from_an_earlier_boot_is_checked_again_once(env, bucket, cache):
    sd, url, opts = _sd(4), f"s3://{bucket}/ck", {"cache_dir": cache}
    mmapckpt.save(sd, url)
    mmapckpt.load(url, storage_options=opts)
    shard, meta = _shard(url, cache), Entry(cache, f"{url}/.metadata")
    for e in (shard, meta):  # as if written before the machine went down and came up again
        rec = e.read_record()
        with open(e.record, "w") as f:
            json.dump({**rec, "boot": "an-earlier-boot"}, f)
    with GetCounter() as again:
        assert_same(mmapckpt.load(url, storage_options=opts), sd, "after a reboot: ")
    assert again.ranges and all(key.endswith(".metadata") for key, _, _ in again.ranges)  # no CRCs: fetched again
    assert shard.read_record()["boot"] == entry.boot_id()  # its CRC-32s passed: kept, now of this boot
