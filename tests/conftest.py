import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # `import helpers` from tests and from spawned ranks

# The cold-read choice (io/read_choice.py) keeps its samples in a per-user file across processes; the suite keeps
# them in memory only, so that tests neither read what another run measured nor leave files behind
# (tests/io/test_read_choice_state.py turns it on, in a temporary directory).
os.environ.setdefault("MMAPCKPT_READ_CHOICE", "off")
