"""Several processes loading one URL at once fetch each byte once (counted at each process's client), and the
size bound evicts the least recently used copies, never one a process has mapped."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time

import torch
from s3_data import GetCounter, assert_same, raw, state_dict
from test_cache_loads import each_byte_once

import mmapckpt
from mmapckpt.storage.cache.entry import Entry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
S3_TESTS = os.path.join(ROOT, "tests", "s3")

_LOADER = textwrap.dedent("""
    import json, os, sys, time, zlib
    from s3_data import GetCounter, raw
    import mmapckpt
    url, cache, go, ready = sys.argv[1:5]
    open(ready, "w").close()
    while not os.path.exists(go):  # all start together
        time.sleep(0.005)
    with GetCounter() as c:
        sd = mmapckpt.load(url, storage_options={"cache_dir": cache})
    print(json.dumps({"ranges": c.ranges, "crc": {k: zlib.crc32(raw(v)) for k, v in sd.items()}}))
""")


def test_processes_loading_one_url_together_fetch_each_byte_once(env, bucket, cache, s3_server, tmp_path):
    import zlib
    sd, url = {k: v for k, v in state_dict(salt=1).items() if v.numel()}, f"s3://{bucket}/ck"
    sd["more"] = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB: a fetch long enough to overlap the others
    mmapckpt.save(sd, url)
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _LOADER, url, cache, str(go), str(tmp_path / f"ready{i}")],
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, S3_TESTS])},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{i}").exists() for i in range(3)) and time.monotonic() < deadline:
            time.sleep(0.01)  # every child has imported torch and mmapckpt
        go.touch()
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    results = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    want = {k: zlib.crc32(raw(v)) for k, v in sd.items()}
    assert all(r["crc"] == want for r in results)
    together = GetCounter()
    together.ranges = [tuple(x) for r in results for x in r["ranges"]]
    assert each_byte_once(together, s3_server.client(), bucket) > 44 << 20  # all children together: 1.0x


def _ckpt(bucket: str, name: str, salt: int) -> tuple[str, dict[str, torch.Tensor]]:
    sd = {"w": torch.arange(256 << 10, dtype=torch.float32) + salt}  # 1 MiB
    url = f"s3://{bucket}/{name}"
    mmapckpt.save(sd, url)
    return url, sd


def _cached(cache: str, url: str) -> bool:
    return os.path.exists(Entry(cache, f"{url}/__0_0.distcp").data)


def test_least_recently_used_copies_are_evicted_first(env, bucket, cache):
    urls = {n: _ckpt(bucket, n, i) for i, n in enumerate("abc")}
    opts = {"cache_dir": cache, "cache_max_bytes": int(2.5 * (1 << 20))}
    for n in "aba":  # a used again after b
        assert_same(mmapckpt.load(urls[n][0], storage_options=opts), urls[n][1], n)
        gc.collect()
        time.sleep(0.05)
    mmapckpt.load(urls["c"][0], storage_options=opts)
    assert [_cached(cache, urls[n][0]) for n in "abc"] == [True, False, True]


def test_a_mapped_copy_is_never_evicted(env, bucket, cache):
    urls = {n: _ckpt(bucket, n, i) for i, n in enumerate("abc")}
    opts = {"cache_dir": cache, "cache_max_bytes": int(1.5 * (1 << 20))}
    a_url, a_sd = urls["a"]
    assert_same(mmapckpt.load(a_url, storage_options=opts), a_sd, "a")  # fetched (its views are copies: filling.py)
    gc.collect()
    with mmapckpt.open(a_url, storage_options=opts) as f:
        view = f.get_tensor("w")  # a view over the copy's mapping
    time.sleep(0.05)
    assert_same(mmapckpt.load(urls["b"][0], storage_options=opts), urls["b"][1], "b")
    gc.collect()
    assert _cached(cache, a_url)  # over the bound, but a is mapped
    assert raw(view) == raw(a_sd["w"])
    del view, f
    gc.collect()
    time.sleep(0.05)
    mmapckpt.load(urls["c"][0], storage_options=opts)
    assert not _cached(cache, a_url)  # unmapped now: evicted
