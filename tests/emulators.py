"""Real object-store emulators for the tests: Azurite (Azure Blob) and gcp-storage-emulator (GCS), on 127.0.0.1.

Each runs as one child process on a free port, all of its state in one directory, started with a
bounded wait (``StartError`` with the log's tail when it does not come up) and stopped by its PID
(SIGTERM, then SIGKILL), also when the process that started it dies (``setpriv --pdeathsig``).

- Azurite: npm ``azurite`` (.ci/run installs it into ``~/.cache/mmapckpt-ci/azurite``; also found on
  PATH or at ``MMAPCKPT_AZURITE``, the path of its ``azurite-blob``); node 20 runs it, despite the
  engines field's ">=22". The development account ``devstoreaccount1`` and its well-known key.
- gcp-storage-emulator: PyPI (the test extra), run with this interpreter, in memory. Its server (the standard
  library's single-threaded ``http.server.HTTPServer``) listens with socketserver's backlog of 5 and closes every
  connection after its answer, so a load of 8 or more concurrent GETs overflowed the queue and each dropped SYN
  cost a 1 s retransmission (``TcpExtListenDrops``); it is started with a backlog of 128, as a real front end
  queues, and serves one request at a time as before.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from s3server import StartError, _tail, _with_parent, free_port

AZURITE_ACCOUNT = "devstoreaccount1"
#: Azurite's documented development key (public; every Azurite has it)
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE_CACHE = Path.home() / ".cache" / "mmapckpt-ci" / "azurite" / "node_modules" / ".bin" / "azurite-blob"


def azurite_binary() -> str | None:
    """The ``azurite-blob`` to run, or None."""
    for candidate in (os.environ.get("MMAPCKPT_AZURITE"), str(AZURITE_CACHE), shutil.which("azurite-blob")):
        if candidate and os.access(candidate, os.X_OK) and shutil.which("node"):
            return candidate
    return None


def gcs_emulator_missing() -> str | None:
    """Why the GCS emulator cannot run here, or None."""
    try:
        import gcp_storage_emulator  # noqa: F401
    except ImportError:
        return "gcp-storage-emulator is not installed (the test extra: pip install -e '.[test]')"
    return None


class _Child:
    """One emulator process, its log in ``root/log``."""

    name = "emulator"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ready_url(self) -> str:
        raise NotImplementedError

    def start(self, timeout: float = 60.0) -> None:
        log = open(self.root / "log", "wb")
        try:
            self.proc = subprocess.Popen(_with_parent(self._command()), cwd=self.root, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                urllib.request.urlopen(self._ready_url(), timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # it answers (an unsigned request is refused): up
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise StartError(f"{self.name} did not come up on port {self.port}:\n{_tail(self.root / 'log')}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(2)  # state is in memory or in a temp dir: nothing to flush (Azurite lingers ~10 s on keep-alives)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Azurite(_Child):
    """Azurite's blob service: ``connection_string``, ``endpoint``, ``new_container()``, ``client()``."""

    name = "Azurite"

    def _command(self) -> list[str]:
        binary = azurite_binary()
        if binary is None:
            raise StartError("no azurite-blob (npm install azurite) or no node")
        return [binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--skipApiVersionCheck", "--loose", "--silent", "--inMemoryPersistence"]

    def _ready_url(self) -> str:
        return f"{self.endpoint}?comp=list"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                f"BlobEndpoint={self.endpoint};")

    def options(self) -> dict[str, str]:
        return {"connection_string": self.connection_string}

    def service(self):  # type: ignore[no-untyped-def]
        from azure.storage.blob import BlobServiceClient
        return BlobServiceClient.from_connection_string(self.connection_string)

    def new_container(self, stem: str = "test") -> str:
        name = f"{stem}-{uuid.uuid4().hex[:12]}"
        self.service().create_container(name)
        return name

    def delete_container(self, name: str) -> None:
        try:
            self.service().delete_container(name)
        except Exception:
            pass


class GCSEmulator(_Child):
    """gcp-storage-emulator, in memory: ``endpoint``, ``options()``, ``new_bucket()``."""

    name = "gcp-storage-emulator"

    #: the emulator's own entry point, its listening socket's backlog raised from socketserver's 5
    _LAUNCH = ("import runpy, socketserver; socketserver.TCPServer.request_queue_size = 128; "
               "runpy.run_module('gcp_storage_emulator', run_name='__main__', alter_sys=True)")

    def _command(self) -> list[str]:
        return [sys.executable, "-c", self._LAUNCH, "start", "--host", "127.0.0.1", "--port", str(self.port),
                "--in-memory"]

    def _ready_url(self) -> str:
        return f"{self.endpoint}/storage/v1/b"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def options(self) -> dict[str, object]:
        return {"endpoint_url": self.endpoint, "anon": True, "project": "test"}

    def new_bucket(self, stem: str = "test") -> str:
        import json
        name = f"{stem}-{uuid.uuid4().hex[:12]}"
        req = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project=test", method="POST",
                                     data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()
        return name
