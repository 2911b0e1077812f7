"""What a load decides about staging before it needs the pipeline: the defaults, the device check, the choice.

io/staging.py (the pinned ring, its filler thread, host registration) is imported only by a load
that has an accelerator target (or CPU targets routed through it by tests): about a tenth of
``import mmapckpt`` + ``load_into`` in a new process, for nothing on a CPU-only load. So the
names every load reads (the defaults of its keyword arguments, :func:`check_device`,
:func:`needs_staging`) live here, and staging.py takes them from here.
"""

from __future__ import annotations

import sys
import warnings

import torch

__all__ = ["DEFAULT_STAGING_BYTES", "DEFAULT_STAGING_BUFFERS", "check_device", "staging_options",
           "needs_staging", "stage_cpu_targets"]

#: 32 MiB a buffer: a copy's fixed cost (~10 us to launch) is under 2% of moving 32 MiB at
#: 25-50 GB/s, and one buffer still holds the largest layer of most models in a few pieces.
DEFAULT_STAGING_BYTES = 32 << 20
#: Three buffers: one being filled by the host, one being copied by the device, one spare so
#: that a slow read or copy does not stall the other side. 96 MiB of pinned memory in all.
DEFAULT_STAGING_BUFFERS = 3

_STAGING = __name__.rpartition(".")[0] + ".staging"


def stage_cpu_targets() -> bool:
    """io/staging.py's test switch ``STAGE_CPU_TARGETS``. Only code that imported that module can have turned it
    on, so where it is not imported the answer is False, and asking imports nothing."""
    mod = sys.modules.get(_STAGING)
    return bool(mod is not None and mod.STAGE_CPU_TARGETS)


def needs_staging(t: torch.Tensor) -> bool:
    """Whether a copy into ``t`` goes through the staging pipeline: accelerator targets (and CPU ones in tests)."""
    return not t.is_cpu or stage_cpu_targets()


def check_device(device: torch.device) -> None:
    """Raise a clear RuntimeError, before any work, for an accelerator this process cannot use (ValueError for
    the meta device, which no build can load onto)."""
    if device.type == "cpu":
        return
    if device.type == "meta":  # torch has it in every build; it has no memory, so nothing can be loaded there
        raise ValueError("device 'meta' holds no data, so nothing can be loaded onto it: load to a device with "
                         "memory ('cpu', the default, or an accelerator). To load a model built on the meta "
                         "device, pass it to mmapckpt.load_model, which replaces its meta tensors with the "
                         "checkpoint's on the CPU (or on device=)")
    try:
        mod = torch.get_device_module(device)
        available = bool(mod.is_available())
    except (AttributeError, RuntimeError):
        available = False
    if not available:
        raise RuntimeError(f"device {str(device)!r} is not available in this process (torch {torch.__version__}"
                           f"{', built without CUDA' if device.type == 'cuda' and torch.version.cuda is None else ''}"
                           "); load to device='cpu', or install a torch build for that device")


def staging_options(staging_bytes: int | None, staging_buffers: int | None, buffer_bytes: int | None,
                    num_buffers: int | None, where: str) -> tuple[int, int]:
    """The staging size and count, taking the deprecated ``buffer_bytes``/``num_buffers`` aliases."""
    for old, new, value in (("buffer_bytes", "staging_bytes", buffer_bytes), ("num_buffers", "staging_buffers",
                                                                              num_buffers)):
        if value is not None:
            warnings.warn(f"{where}: {old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)
    nbytes = staging_bytes if staging_bytes is not None else buffer_bytes
    count = staging_buffers if staging_buffers is not None else num_buffers
    return (DEFAULT_STAGING_BYTES if nbytes is None else nbytes, DEFAULT_STAGING_BUFFERS if count is None else count)
