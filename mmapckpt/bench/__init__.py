"""``mmapckpt bench`` and ``mmapckpt demo``: the side-by-side benchmark, its methods, the
machine's limits, synthetic state dicts. ``import mmapckpt`` never imports this wing.
"""
