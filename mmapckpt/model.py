"""``mmapckpt.load_model``: a checkpoint into an ``nn.Module``, also one built on the meta device.

The counterpart of ``safetensors.torch.load_model``. A model built under
``torch.device("meta")`` has no memory: its tensors are replaced by the checkpoint's
(copy-on-write views over the file mappings on the CPU, cast to the model's dtypes), as
``load_state_dict(..., assign=True)`` does. Tensors the model already holds in memory are
filled in place (``load_into``'s direct reads). What ``load_state_dict`` leaves out is
handled here:

* tied weights follow the model: names sharing one Parameter (or buffer) are found on the
  model before loading; a checkpoint holding one of them (``save`` and ``save_pretrained``
  store a tie once) fills them all, and after assignment they are one Parameter again. Names
  the model keeps apart get tensors sharing no memory, even where the checkpoint stores them
  once (``mmapckpt.save`` of a tied model): an update of one never changes the other;
* casts to the model's dtypes follow ``format/casts.py`` (refused beyond rounding unless
  ``allow_cast``), checked, like names and shapes, before the model is changed;
* non-persistent buffers (BERT's ``position_ids``, rotary ``inv_freq``): loaded when the
  checkpoint holds them; otherwise, on a meta model, computed by the model's own
  initialisation where it has one (the ``transformers`` ``initialize_weights`` protocol,
  which is how ``from_pretrained`` fills them), with every loaded tensor protected from it;
* anything still on the meta device after that raises :class:`ModelMismatchError` naming it,
  as does a tensor that initialisation did not write (its version counter did not move).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
from torch import nn

from .errors import ModelMismatchError, SizeMismatchError
from .format.aliases import shared_names
from .format.casts import check_cast
from .io.staging_options import check_device
from .lazy import LazyCheckpoint, read_tensors
from .records import Record

__all__ = ["load_model"]

_CAST_FIX = "build the model with the checkpoint's dtype, or pass allow_cast=True to cast anyway"


class _Slot(Record):
    """Where a model keeps the tensor of one name."""

    __slots__ = ()

    module: nn.Module
    attr: str
    is_param: bool
    persistent: bool

    def __new__(cls, module: nn.Module, attr: str, is_param: bool, persistent: bool) -> _Slot:
        return tuple.__new__(cls, (module, attr, is_param, persistent))

    def get(self) -> torch.Tensor:
        return (self.module._parameters if self.is_param else self.module._buffers)[self.attr]  # type: ignore[return-value]

    def put(self, t: torch.Tensor) -> None:
        if self.is_param:
            old = self.module._parameters[self.attr]
            self.module._parameters[self.attr] = t if isinstance(t, nn.Parameter) else nn.Parameter(
                t, requires_grad=bool(old is not None and old.requires_grad))
        else:
            self.module._buffers[self.attr] = t


def _slots(model: nn.Module) -> dict[str, _Slot]:
    """Every parameter and buffer name of ``model``, tied names included."""
    out: dict[str, _Slot] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in mod._parameters.items():
            if p is not None:
                out[prefix + attr] = _Slot(mod, attr, True, True)
        for attr, b in mod._buffers.items():
            if b is not None:
                out[prefix + attr] = _Slot(mod, attr, False, attr not in mod._non_persistent_buffers_set)
    return out


def _tie_groups(slots: dict[str, _Slot]) -> list[list[str]]:
    """Names sharing one tensor object (``lm_head.weight`` and ``embed_tokens.weight``), in model order."""
    by_id: dict[int, list[str]] = {}
    for name, slot in slots.items():
        by_id.setdefault(id(slot.get()), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def load_model(model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True,
               device: str | torch.device | None = None, strip_prefix: str | None = None,
               storage_options: Mapping[str, Any] | None = None,
               allow_cast: bool = False) -> tuple[list[str], list[str]]:
    """Load a checkpoint into ``model``, also one built on the meta device, as
    ``safetensors.torch.load_model`` does for one safetensors file.

    Tensors on the meta device (or, with ``device``, on another device) are replaced by the
    checkpoint's, cast to the model's dtype (views over the file mappings on the CPU: no byte
    is read until used); tensors already in memory are filled in place. The checkpoint is opened
    once: everything comes from the one save it held then. Ties follow the model: tied weights
    stored once fill every name of the tie and stay one Parameter, and names the model keeps
    apart never share memory (one stored under both names is copied for the second). Non-persistent buffers take the
    checkpoint's value when it holds one; otherwise, on a meta model, the model's own
    initialisation computes them (``transformers`` models: ``initialize_weights``, as
    ``from_pretrained`` does). When ``load_model`` returns, nothing is left on the meta device.

    Args:
        model: the module to load into (built on the meta device, or in memory).
        path: a checkpoint directory or file in any format :func:`mmapckpt.open` takes.
        strict: raise ModelMismatchError when the model has names the checkpoint lacks (missing)
            or the checkpoint has tensors the model does not take (unexpected); with False,
            they are returned, and missing tensors of a meta model are initialised by the model
            (or raise ModelMismatchError if it has no initialisation).
        device: where replaced tensors are created (default: the CPU); tensors of the model
            already on another device are moved there. ``"meta"`` is refused (ValueError): it
            holds no data to load into.
        strip_prefix: remove this prefix from the checkpoint's names that start with it first
            (a ``model.``-prefixed training checkpoint; see :func:`mmapckpt.open`).
        storage_options: settings of an object store's client (see :func:`mmapckpt.open`).
        allow_cast: cast to the model's dtypes even where that changes values beyond rounding
            (see :func:`mmapckpt.load_into`); refused by default.

    Returns:
        ``(missing, unexpected)``: sorted lists of names, as safetensors' ``load_model`` returns.

    Raises:
        ModelMismatchError: ``strict`` and names missing or unexpected; tied names stored with
            different values; a tensor on the meta device that nothing can fill (named).
        SizeMismatchError: a stored shape other than the model's.
        CastError: a cast to the model's dtype refused (see ``allow_cast``); the model is left unchanged.
        CheckpointError: a damaged checkpoint (see :func:`mmapckpt.open`).

    Example:
        >>> with torch.device("meta"):
        ...     model = AutoModel.from_config(AutoConfig.from_pretrained("model_dir"))
        >>> mmapckpt.load_model(model, "model_dir")
        ([], [])
    """
    dev = torch.device("cpu") if device is None else torch.device(device)
    check_device(dev)
    slots = _slots(model)
    groups = _tie_groups(slots)
    with LazyCheckpoint(path, strip_prefix=strip_prefix, storage_options=storage_options) as ckpt:
        where = ckpt.path
        stored = {n: ckpt.info(n) for n in ckpt.keys()}
        source = {n: n for n in slots if n in stored and stored[n].kind == "tensor"}
        for group in groups:
            present = [n for n in group if n in source]
            _check_tie(ckpt, present)
            for n in group if present else ():
                source.setdefault(n, present[0])
        expected = [n for n, s in slots.items() if s.persistent]
        missing = sorted(n for n in expected if n not in source)
        unexpected = sorted(n for n in stored if n not in slots)
        if strict and (missing or unexpected):
            raise ModelMismatchError(_mismatch(model, missing, unexpected), path=where)
        for n, src in source.items():
            shape, dtype = tuple(slots[n].get().shape), slots[n].get().dtype
            if stored[src].shape != shape:
                raise SizeMismatchError(f"stored tensor is {list(stored[src].shape or ())} but the model's {n!r} is "
                                        f"{list(shape)}", path=where, entry=stored[src].name)
            check_cast(None, stored[src].dtype, dtype, allow_cast=allow_cast, path=where, entry=stored[src].name,
                       fix=_CAST_FIX)
        assign = [n for n in source if slots[n].get().is_meta or (device is not None and slots[n].get().device != dev)]
        # everything read and checked before the model is changed: a refused cast leaves it as it was
        given = _assigned(ckpt, slots, {n: source[n] for n in assign}, groups, dev, allow_cast)
        fill = {source[n]: slots[n].get() for n in source if n not in assign}
        if fill:  # tensors already in memory: load_into's reads (a meta model's are views, into.py not needed)
            from .into import fill_from

            fill_from(ckpt, fill, allow_cast=allow_cast, values_first=True)  # a refusal leaves the model as it was
        _put(model, slots, given)
    for group in groups:  # assignment made one Parameter per name: one again
        for n in group[1:]:
            slots[n].put(slots[group[0]].get())
    _materialise(model, slots, groups, dev, where)
    return missing, unexpected


def _check_tie(ckpt: LazyCheckpoint, present: list[str]) -> None:
    """Tied names stored separately must hold the same values: the model can keep only one."""
    if len(present) < 2:
        return
    aliases = shared_names({n: ckpt.info(n) for n in present}, present)
    apart = [n for n in present[1:] if n not in aliases]  # stored once (save's aliases): nothing to read
    first = ckpt.get_tensor(present[0]) if apart else None
    for n in apart:
        if not torch.equal(first, ckpt.get_tensor(n)):
            raise ModelMismatchError(f"the model ties {present[0]!r} and {n!r} (one Parameter), but the checkpoint "
                                     "holds different values for them; untie them in the model to load both",
                                     path=ckpt.path, entry=ckpt.info(n).name)


def _mismatch(model: nn.Module, missing: list[str], unexpected: list[str]) -> str:
    """The message ``load_state_dict(strict=True)`` gives, with a hint."""
    text = f"Error(s) in loading state_dict for {type(model).__name__}:"
    if missing:
        text += f"\n    Missing key(s) in state_dict: {', '.join(repr(k) for k in missing[:20])}"
        text += f" (and {len(missing) - 20} more)" if len(missing) > 20 else ""
    if unexpected:
        text += f"\n    Unexpected key(s) in state_dict: {', '.join(repr(k) for k in unexpected[:20])}"
        text += f" (and {len(unexpected) - 20} more)" if len(unexpected) > 20 else ""
    return text + "\n(pass strict=False to load the rest and get these names back, or strip_prefix= for prefixed names)"


def _assigned(ckpt: LazyCheckpoint, slots: dict[str, _Slot], sources: dict[str, str], groups: list[list[str]],
              dev: torch.device, allow_cast: bool) -> dict[str, torch.Tensor]:
    """The tensors that replace those of ``sources`` (model name -> checkpoint name), read from the open ``ckpt``
    on ``dev`` and cast to the model's dtypes (each cast checked first). Names the model ties share one tensor;
    names it keeps apart get tensors that share no memory, even where the checkpoint stores them once."""
    if not sources:
        return {}
    loaded = read_tensors(ckpt, list(dict.fromkeys(sources.values())), dev)
    cast: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # one tensor per stored tensor and dtype
    out: dict[str, torch.Tensor] = {}
    for n, src in sources.items():
        t, dtype = loaded[src], slots[n].get().dtype
        key = (id(t), dtype)
        if key not in cast:
            check_cast(t, t.dtype, dtype, allow_cast=allow_cast, path=ckpt.path, entry=ckpt.info(src).name,
                       fix=_CAST_FIX)
            cast[key] = t if t.dtype == dtype else t.to(dtype)
        out[n] = cast[key]
    _keep_apart(out, {n: g[0] for g in groups for n in g})
    return out


def _span(t: torch.Tensor) -> tuple[str, int, int]:
    """The device and the byte range ``[start, end)`` that ``t``'s elements lie in."""
    if t.numel() == 0:
        return str(t.device), 0, 0
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return str(t.device), t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _keep_apart(out: dict[str, torch.Tensor], tie_of: dict[str, str]) -> None:
    """Give each name of ``out`` whose memory overlaps that of a name the model does not tie to it a copy of
    its own: the checkpoint's aliases (``mmapckpt.save`` of a tied model, a torch.save file's shared storages)
    would otherwise make an update of one (an optimizer step) change the other."""
    spans = sorted((_span(t), n) for n, t in out.items())
    active: list[tuple[str, int, str]] = []  # (device, end, tie) of the ranges that may still overlap
    for (device, start, end), n in spans:
        if end == start:
            continue
        active = [a for a in active if a[0] == device and a[1] > start]
        tie = tie_of.get(n, n)
        if any(a[2] != tie for a in active):
            out[n] = out[n].clone()  # new memory: overlaps nothing
            continue
        active.append((device, end, tie))


def _put(model: nn.Module, slots: dict[str, _Slot], tensors: dict[str, torch.Tensor]) -> None:
    """Replace the model's tensors with ``tensors``: persistent ones through ``load_state_dict(assign=True)`` (so
    modules' own load hooks run), non-persistent buffers directly (``load_state_dict`` skips them)."""
    persistent: dict[str, torch.Tensor] = {}
    for n, t in tensors.items():
        if slots[n].persistent:
            persistent[n] = t
        else:
            slots[n].put(t)
    if persistent:
        model.load_state_dict(persistent, strict=False, assign=True)


def _materialise(model: nn.Module, slots: dict[str, _Slot], groups: list[list[str]], dev: torch.device,
                 where: str) -> None:
    """Compute what is still on the meta device with the model's own initialisation, or raise naming it."""
    left = [n for n, s in slots.items() if s.get().is_meta]
    if not left:
        return
    init = getattr(model, "initialize_weights", None)
    if not callable(init) or not hasattr(model, "_init_weights"):
        raise ModelMismatchError(_left_message(left, "the model has no initialisation that could compute them "
                                                     "(transformers' initialize_weights)"), path=where)
    tie_of = {n: g[0] for g in groups for n in g}
    fresh: dict[str, torch.Tensor] = {}
    for n in left:
        first = tie_of.get(n, n)
        if first not in fresh:
            old = slots[n].get()
            fresh[first] = torch.empty_like(old, device=dev)
            if slots[n].is_param:
                fresh[first] = nn.Parameter(fresh[first], requires_grad=old.requires_grad)
        slots[n].put(fresh[first])
    versions = {n: slots[n].get()._version for n in left}
    unwritten = _run_init(model, slots, set(left), init)
    unwritten += [n for n in left if slots[n].get()._version == versions[n] and n not in unwritten]
    if unwritten:
        raise ModelMismatchError(_left_message(sorted(unwritten), f"{type(model).__name__}.initialize_weights() "
                                                                  "did not compute them"), path=where)


def _run_init(model: nn.Module, slots: dict[str, _Slot], left: set[str], init: Any) -> list[str]:
    """``model.initialize_weights()`` with every loaded tensor, and every module owning only loaded tensors,
    flagged ``_is_hf_initialized`` (transformers' guarded init functions then leave them alone); the flags
    this call set are removed again. Returns the names still on the meta device."""
    flagged: list[Any] = []
    owners = {id(slots[n].module) for n in left}
    for n, s in slots.items():
        t = s.get()
        if n not in left and not getattr(t, "_is_hf_initialized", False):
            t._is_hf_initialized = True  # type: ignore[attr-defined]
            flagged.append(t)
    for m in model.modules():
        if id(m) not in owners and not getattr(m, "_is_hf_initialized", False):
            m._is_hf_initialized = True  # type: ignore[assignment]
            flagged.append(m)
    try:
        with torch.no_grad():
            init()
    finally:
        for obj in flagged:
            if "_is_hf_initialized" in getattr(obj, "__dict__", {}):
                del obj._is_hf_initialized
    return [n for n in left if slots[n].get().is_meta]


def _left_message(names: list[str], why: str) -> str:
    shown = ", ".join(repr(n) for n in names[:20]) + (f" (and {len(names) - 20} more)" if len(names) > 20 else "")
    return (f"left on the meta device: {shown}: the checkpoint does not hold them and {why}. Build the model on a "
            "real device, or compute them before use")
