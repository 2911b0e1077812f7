"""A torch.save file's state dict flattened as ``dcp.save`` names it (reading/torchfile.py ``flat_torch_file``).

A flat dict of tensors (``pytorch_model.bin``) is flattened without DCP's walk (so that a single-process
load imports no ``torch.distributed.checkpoint``); the result must be exactly what DCP's
``flatten_state_dict`` gives, for flat and nested files alike.
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from mmapckpt.reading.located import locate
from mmapckpt.reading.torchfile import flat_torch_file


def test_flat_and_nested_files_flatten_as_dcp_does(tmp_path: Path) -> None:
    flat = collections.OrderedDict([("embed.weight", torch.ones(2, 3)), ("b", torch.arange(4)),
                                    ("p", torch.nn.Parameter(torch.zeros(1)))])
    nested = {"model": {"w": torch.ones(2)}, "step": 3, "lrs": [torch.zeros(1), 0.1]}
    for name, obj in (("flat.pt", flat), ("nested.pt", nested)):
        torch.save(obj, tmp_path / name)
        got, got_map = flat_torch_file(locate(str(tmp_path / name)))
        want, want_map = flatten_state_dict(torch.load(tmp_path / name, weights_only=True))
        assert list(got) == list(want) and got_map == want_map, name
        for k in want:
            if isinstance(want[k], torch.Tensor):
                assert torch.equal(got[k], want[k]) and type(got[k]) is type(want[k]), (name, k)
            else:
                assert got[k] == want[k], (name, k)
