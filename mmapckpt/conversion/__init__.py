"""Conversions between mmapckpt, stock DCP, safetensors and torch.save.

``common`` (the Source interface and dtype table) at the bottom; ``sources`` (DCP
directories), ``flat`` (safetensors, torch.save) and ``sinks`` (writers) beside each
other, never importing one another; ``detect`` picks a source; ``driver`` runs a
conversion; ``progress`` is the bar and callback of long jobs (convert here, and
``mmapckpt verify`` in tools/). The wing is named ``conversion`` so that ``mmapckpt.convert`` stays the function.
"""
