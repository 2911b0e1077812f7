"""Thin adapters to torch.distributed.checkpoint's interfaces: MmapWriter, MmapReader and
the load planners. Imports the format and io wings below it, nothing above.
"""
