"""The names of the format families (what ``open(...).kind``, ``inspect`` and ``convert(to=)`` call a format),
importable without torch (the command line's ``--to`` choices); their records are in reading/formats.py."""

__all__ = ["FORMATS"]

FORMATS = ("mmapckpt", "dcp", "safetensors", "torch")
