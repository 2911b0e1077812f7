"""Where a checkpoint's bytes live: the storage interface (base.py) and its local implementation (local.py)."""
