"""Retention over 20 saves on both media: the right steps kept, each loading bitwise, nothing else left under the root."""

from __future__ import annotations

import pytest
from manage_data import blank, same, state, stored_files, uploads_in_progress

import mmapckpt

#: (keep_last, keep_every) -> the steps of 1..20 that stay, written out by hand
CASES = {
    (1, None): {20},
    (3, None): {18, 19, 20},
    (2, 5): {5, 10, 15, 19, 20},
    (1, 7): {7, 14, 20},
    (4, 3): {3, 6, 9, 12, 15, 17, 18, 19, 20},
    (None, None): set(range(1, 21)),
}
#: the pairs run on the object store too (each S3 save costs a few requests)
S3_CASES = {(2, 5)}


_RUNS = [pytest.param(kind, keep, id=f"{kind}-last{keep[0]}-every{keep[1]}",
                      marks=[pytest.mark.s3] if kind == "s3" else [])
         for keep in CASES for kind in ("local", "s3") if kind == "local" or keep in S3_CASES]


@pytest.mark.parametrize("medium, keep", _RUNS, indirect=["medium"])
def test_retention_keeps_the_right_steps_over_20_saves(medium, keep):
    keep_last, keep_every = keep
    m = mmapckpt.CheckpointManager(medium.root, keep_last=keep_last, keep_every=keep_every,
                                   storage_options=medium.options)
    assert m.steps() == [] and m.latest() is None
    for step in range(1, 21):
        m.save(state(step), step)
        assert m.latest() == step
    assert m.steps() == sorted(CASES[keep])
    for step in m.steps():
        got = blank()
        assert m.load(got, step) == step
        assert same(got, state(step)), f"step {step} does not load bitwise"
    # nothing but the kept steps' files, the marker and (locally) the empty lease directory
    files = stored_files(medium.root, medium.client)
    steps_stored = {name.split("/")[0] for name in files if name.startswith("step-")}
    assert steps_stored == {f"step-{s}" for s in CASES[keep]}
    for s in CASES[keep]:
        assert sorted(n.split("/", 1)[1] for n in files if n.startswith(f"step-{s}/")) == [".metadata", "__0_0.distcp"]
    assert set(files) - {n for n in files if n.startswith("step-")} == {".mmapckpt-root"}
    assert not uploads_in_progress(medium.root, medium.client)
    plain = mmapckpt.load(m.path(m.latest()), storage_options=medium.options)  # an ordinary checkpoint
    assert same(plain, {k: v for k, v in state(20).items() if k != "step"})


def test_async_saves_commit_then_retain(medium):
    m = mmapckpt.CheckpointManager(medium.root, keep_last=2, storage_options=medium.options)
    stager = mmapckpt.PinnedStager()
    try:
        futures = [m.save(state(step), step, async_=True, stager=stager) for step in range(1, 5)]
        futures[-1].result()
    finally:
        stager.close()
    assert all(f.done() for f in futures)
    assert m.steps() == [3, 4]
    got = blank()
    assert m.load(got) == 4 and same(got, state(4))
