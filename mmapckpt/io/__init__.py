"""Byte movement that knows no format: positional reads and writes, O_DIRECT, atomic commits,
safe paths, mapped files, pinned staging to and from accelerators, progress reporting.

Imports only ``mmapckpt.errors``.
"""
