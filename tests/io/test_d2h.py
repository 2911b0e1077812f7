"""stage_to_host on the CPU: tensors pass through untouched, in order, resolved once each."""

import torch

from mmapckpt.io.d2h import stage_to_host


def test_cpu_tensors_pass_through_in_order():
    ts = [torch.randn(5) for _ in range(7)]
    calls = []

    def resolve(i):
        calls.append(i)
        return ts[i]

    out = list(stage_to_host(range(7), resolve, budget=1))
    assert [i for i, _ in out] == list(range(7))
    assert all(t.data_ptr() == ts[i].data_ptr() for i, t in out)  # no copy on the CPU
    assert calls == list(range(7))


def test_resolution_is_lazy():
    """Items are resolved as the consumer advances, not all up front (CPU tensors have no budget cost,
    so at most one is resolved ahead)."""
    resolved = []

    def resolve(i):
        resolved.append(i)
        return torch.zeros(1)

    gen = stage_to_host(range(100), resolve)
    next(gen)
    assert len(resolved) <= 2
