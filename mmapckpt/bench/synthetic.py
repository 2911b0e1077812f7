"""Transformer-shaped synthetic state dicts for the demo and the benchmark."""

from __future__ import annotations

import torch

__all__ = ["transformer_state_dict", "parse_size"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """'256MB' -> 256_000_000; '1GiB' -> 2**30; a plain number is bytes."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 256MB, 1GB, 512MiB")
    return int(float(num) * _UNITS[unit])


def transformer_state_dict(total_bytes: int, *, dtype: torch.dtype = torch.bfloat16, layers: int = 0,
                           seed: int = 0) -> dict[str, torch.Tensor]:
    """A GPT-like state dict of about ``total_bytes``: embeddings, per-layer attention and MLP
    weights, norms and biases. ``layers`` (0: chosen from the size) sets the tensor count,
    10 tensors a layer plus 3. Values are random so compression or zero pages cannot help.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    n_layers = layers or max(2, min(32, int((total_bytes / 2**20) ** 0.5 / 2)))
    # per layer: qkv (3d*d) + proj (d*d) + mlp up/down (2 * 4d*d) = 12 d^2; embeddings: 2 * V * d with V = 8d
    # -> total ~ (12 L + 16) d^2 elements
    d = max(8, int((total_bytes / itemsize / (12 * n_layers + 16)) ** 0.5) // 8 * 8)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        if dtype.is_floating_point:
            t.copy_(torch.randn(shape, generator=gen))
        else:
            t.copy_(torch.randint(-100, 100, shape, generator=gen))
        return t

    sd: dict[str, torch.Tensor] = {"tok_embeddings.weight": rand(8 * d, d)}
    for i in range(n_layers):
        p = f"layers.{i}."
        sd[p + "attn_norm.weight"] = rand(d)
        sd[p + "attn.qkv.weight"] = rand(3 * d, d)
        sd[p + "attn.qkv.bias"] = rand(3 * d)
        sd[p + "attn.proj.weight"] = rand(d, d)
        sd[p + "attn.proj.bias"] = rand(d)
        sd[p + "mlp_norm.weight"] = rand(d)
        sd[p + "mlp.up.weight"] = rand(4 * d, d)
        sd[p + "mlp.up.bias"] = rand(4 * d)
        sd[p + "mlp.down.weight"] = rand(d, 4 * d)
        sd[p + "mlp.down.bias"] = rand(d)
    sd["norm.weight"] = rand(d)
    sd["output.weight"] = rand(8 * d, d)
    return sd
