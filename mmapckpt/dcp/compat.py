"""FileSystemWriter/FileSystemReader arguments that MmapWriter/MmapReader take for drop-in use.

Each stock keyword argument of torch 2.13 is either honoured or refused with a message
that says what to use instead; none is silently ignored where it would change the result.
"""

from __future__ import annotations

from typing import Any

from ..format.transforms import StreamTransforms, check_extensions

__all__ = ["writer_compat", "reader_compat"]


def writer_compat(single_file_per_rank: bool, per_thread_copy_ahead: int, cache_staged_state_dict: bool,
                  extensions: Any, serialization_format: Any) -> StreamTransforms | None:
    """Check the stock FileSystemWriter arguments (``single_file_per_rank`` is honoured by the writer).

    Returns the stream transforms of ``_extensions`` (None without any).
    """
    if not isinstance(single_file_per_rank, bool):
        raise TypeError(f"single_file_per_rank must be a bool, got {single_file_per_rank!r}")
    if not isinstance(per_thread_copy_ahead, int) or per_thread_copy_ahead < 0:
        raise ValueError(f"per_thread_copy_ahead must be a non-negative int, got {per_thread_copy_ahead!r}")
    # per_thread_copy_ahead: accepted; the writer's copies from accelerators run ahead of the
    # writes in its own bounded pinned staging (io/d2h.py), whatever this says.
    if cache_staged_state_dict:
        raise ValueError("MmapWriter does not stage for dcp.async_save itself, so it has no staged state dict to "
                         "cache: pass async_stager=torch.distributed.checkpoint.staging.DefaultStager(...) to "
                         "dcp.async_save instead, or cache_staged_state_dict=False")
    fmt = getattr(serialization_format, "value", serialization_format)
    if fmt not in (None, "torch_save"):
        raise ValueError(f"serialization_format={fmt!r}: MmapWriter writes the mmapckpt format; write it and then "
                         "`mmapckpt convert CKPT OUT --to safetensors` for safetensors files")
    items = check_extensions(extensions)
    return StreamTransforms(items) if items else None


def reader_compat(extension_registry: Any) -> StreamTransforms:
    """Check the stock FileSystemReader arguments; return the transforms reads undo (DCP's default registry
    without ``_extension_registry``)."""
    if extension_registry is not None and not hasattr(extension_registry, "from_descriptor_list"):
        raise TypeError("_extension_registry must be a torch.distributed.checkpoint._extension.ExtensionRegistry, "
                        f"got {type(extension_registry).__name__}")
    return StreamTransforms(registry=extension_registry)
