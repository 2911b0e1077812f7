"""tests/s3server.py itself: its command line starts a server that outlives it and stops it by the recorded
PIDs; a start that cannot finish in time raises with the daemons' logs and leaves no daemon behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
import s3server
from botocore.config import Config

SCRIPT = Path(s3server.__file__).resolve()


def test_command_line_start_and_stop(tmp_path) -> None:
    root = tmp_path / "cluster"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    started = subprocess.run([sys.executable, str(SCRIPT), "start", str(root), "--block-gib", "2"],
                             capture_output=True, text=True, timeout=240, env=env, check=False)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        exports = dict(line.removeprefix("export ").split("=", 1) for line in started.stdout.splitlines())
        assert exports["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        assert exports["AWS_REGION"] == "us-east-1"
        pids = json.loads((root / "pids.json").read_text())["pids"]
        assert sorted(pids) == ["client.rgw.test", "mon.a", "osd.0"]
        assert s3server.pids_using(root) == sorted(pids.values())  # they outlived the command
        s3 = boto3.session.Session().client(
            "s3", endpoint_url=exports["AWS_ENDPOINT_URL"], aws_access_key_id=exports["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=exports["AWS_SECRET_ACCESS_KEY"], region_name=exports["AWS_REGION"],
            config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}))
        s3.create_bucket(Bucket="bench")
        s3.put_object(Bucket="bench", Key="k", Body=b"hello")
        assert s3.get_object(Bucket="bench", Key="k")["Body"].read() == b"hello"
    finally:
        stopped = subprocess.run([sys.executable, str(SCRIPT), "stop", str(root)], capture_output=True, text=True,
                                 timeout=120, env=env, check=False)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert s3server.pids_using(root) == []
    assert not (root / "osd").exists() and (root / "log" / "osd.0.log").exists()  # data removed, logs kept
    assert json.loads((root / "pids.json").read_text())["pids"] == {}


def test_start_refuses_a_used_directory(tmp_path) -> None:
    (tmp_path / "something").write_text("x")
    with pytest.raises(s3server.StartError, match="not empty"):
        s3server.RadosGW(tmp_path).start()
    assert (tmp_path / "something").read_text() == "x"


def test_a_start_that_times_out_stops_what_it_started(tmp_path) -> None:
    server = s3server.RadosGW(tmp_path / "cluster", block_bytes=s3server.GiB, start_timeout=1.0)
    with pytest.raises(s3server.StartError) as info:
        server.start()
    assert "not up within 1.0 s" in str(info.value) or "did not finish within" in str(info.value)
    assert s3server.pids_using(tmp_path / "cluster") == []
    assert server.rss() == {}


def test_a_daemon_that_dies_during_start_fails_it_and_the_rest_is_stopped(tmp_path) -> None:
    import socket

    with socket.socket() as taken:  # radosgw cannot bind its port: it exits after mon and OSD are up
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = s3server.RadosGW(tmp_path / "cluster", block_bytes=s3server.GiB, rgw_port=taken.getsockname()[1])
        with pytest.raises(s3server.StartError, match="client.rgw.test exited") as info:
            server.start()
    assert "--- client.rgw.test.log" in str(info.value)
    assert s3server.pids_using(tmp_path / "cluster") == []
