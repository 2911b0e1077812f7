"""The README's examples do what it says: the first snippet runs without a warning; the meta-device recipe's
caveat about non-persistent buffers holds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

import mmapckpt

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)


def test_the_first_snippet_runs_without_warnings(tmp_path) -> None:
    snippet = _python_blocks()[0]
    assert "no_dist=True" in snippet  # the single-process example says so (why: the comment above it)
    check = "\nimport os\nassert os.path.isfile(os.path.join('ckpt', '.metadata'))\nprint('done')\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-W", "error", "-c", snippet + check], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr[-3000:]
    assert proc.stderr == ""


def test_non_persistent_buffers_stay_on_meta_with_assign(tmp_path) -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 4)
            self.register_buffer("position_ids", torch.arange(16), persistent=False)

    path = str(tmp_path / "ckpt")
    mmapckpt.save(Model().state_dict(), path)
    with torch.device("meta"):
        model = Model()
    model.load_state_dict(mmapckpt.load(path), assign=True)
    assert model.emb.weight.device.type == "cpu"
    assert model.position_ids.device.type == "meta"  # not in any state dict: the README says to recompute it
    assert "position_ids" in README.read_text() and "persistent=False" in README.read_text()
