"""The README's training-loop recipe runs, and run again resumes from its latest step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_recipe_resumes(tmp_path):
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)
    recipe = next(b for b in blocks if "CheckpointManager(" in b)
    runs = [subprocess.run([sys.executable, "-c", recipe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           check=False) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    # first run: steps 0..39, saves at 0, 10, 20, 30, keeps the last two and multiples of 50;
    # second run: resumes at 31, saves at 40, 50, 60, 70
    assert [r.stdout.strip() for r in runs] == ["[0, 20, 30]", "[0, 50, 60, 70]"]
