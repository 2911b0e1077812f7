"""The bytes on disk and nothing else: the shard layout, the ``.metadata`` file, the stock
format's metadata and items, a mapped shard with its checks, the index of entries.

Imports ``mmapckpt.io`` and ``mmapckpt.errors`` only; docs/format.md is its specification.
"""
