"""A managed root on Azure Blob (Azurite) and on GCS (gcp-storage-emulator), beside the s3:// runs of the other manager
tests: saves with cross-step references, retention, latest and load bitwise, and a killed save's leftovers cleared.
What is stored is listed with each store's own client, not through mmapckpt."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import pytest
from manage_data import blank, same, state

import mmapckpt
from mmapckpt.storage import storage_for


@dataclass
class ObjectRoot:
    root: str
    options: dict[str, Any]
    stored: Callable[[], dict[str, int]]  # every object under the root, root-relative, with its size


def _az(request: pytest.FixtureRequest) -> Iterator[ObjectRoot]:
    azurite = request.getfixturevalue("azurite")
    container = azurite.new_container("manage")
    prefix = f"run-{uuid.uuid4().hex[:8]}"

    def stored() -> dict[str, int]:
        c = azurite.service().get_container_client(container)
        return {b.name[len(prefix) + 1:]: int(b.size) for b in c.list_blobs(name_starts_with=prefix + "/")}

    try:
        yield ObjectRoot(f"az://{container}/{prefix}", {**azurite.options(), "lock_wait": 5}, stored)
    finally:
        azurite.delete_container(container)


def _gs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[ObjectRoot]:
    emulator = request.getfixturevalue("gcs_emulator")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.endpoint)  # for google's own client below
    bucket = emulator.new_bucket("manage")
    prefix = f"run-{uuid.uuid4().hex[:8]}"

    def stored() -> dict[str, int]:
        from google.cloud import storage
        client = storage.Client(project="test")
        return {b.name[len(prefix) + 1:]: int(b.size) for b in client.list_blobs(bucket, prefix=prefix + "/")}

    # the emulator ignores generation preconditions: an advisory lock (tests/gcs/conftest.py)
    yield ObjectRoot(f"gs://{bucket}/{prefix}", {**emulator.options(), "lock_wait": 5,
                                                 "require_preconditions": False}, stored)


@pytest.fixture(params=[pytest.param("az", marks=pytest.mark.azure), pytest.param("gs", marks=pytest.mark.gcs)])
def object_root(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[ObjectRoot]:
    """A root on Azurite or on the GCS emulator, not yet created."""
    if request.param == "az":
        yield from _az(request)
    else:
        yield from _gs(request, monkeypatch)


def _frozen(step: int) -> dict[str, Any]:
    """Step ``step``'s state with ``model.w`` frozen at step 1's: each save refers to the newest step's copy of it."""
    return {**state(step), "model.w": state(1)["model.w"]}


def test_saves_retention_latest_and_load(object_root: ObjectRoot) -> None:
    m = mmapckpt.CheckpointManager(object_root.root, keep_last=2, storage_options=object_root.options)
    assert m.steps() == [] and m.latest() is None
    for step in range(1, 6):
        m.save(_frozen(step), step)
        assert m.latest() == step
    assert m.steps() == [4, 5]
    for step in (4, 5):
        got = blank()
        assert m.load(got, step) == step
        assert same(got, _frozen(step)), f"step {step} does not load bitwise"
    files = object_root.stored()
    assert {n.split("/")[0] for n in files if n.startswith("step-")} == {"step-1", "step-4", "step-5"}
    # step 1 is dropped (its .metadata gone) but its shard stays: it holds the frozen tensor the kept steps refer to
    assert sorted(n for n in files if n.startswith("step-1/")) == ["step-1/__0_0.distcp"]
    assert ".mmapckpt-root" in files
    # the plain load of the newest step reads the frozen tensor through the cross-step reference (the sibling
    # prefix step-1) bitwise too
    plain = mmapckpt.load(m.path(5), storage_options=object_root.options)
    assert same(plain, {k: v for k, v in _frozen(5).items() if k != "step"})


def test_a_killed_saves_leftovers_are_cleared(object_root: ObjectRoot) -> None:
    m = mmapckpt.CheckpointManager(object_root.root, keep_last=1, storage_options=object_root.options)
    m.save(state(1), 1)
    m.save(state(3), 3)
    # what a save of step 2 killed before its commit leaves: a shard and its lock object, no .metadata
    killed = storage_for(f"{object_root.root}/step-2", options=object_root.options)
    killed.commit("__0_0.distcp", b"half a shard", sync=True)
    killed.commit(".mmapckpt-lock", b"{}", sync=True)
    assert {"step-2/__0_0.distcp", "step-2/.mmapckpt-lock"} <= set(object_root.stored())
    assert m.steps() == [3]  # an uncommitted step is no step
    m.save(state(4), 4)  # retention clears what is below the newest step and not committed
    files = object_root.stored()
    assert {n.split("/")[0] for n in files if n.startswith("step-")} == {"step-4"}
    got = blank()
    assert m.load(got) == 4 and same(got, state(4))


def test_a_root_in_a_missing_bucket_is_named_not_empty(object_root: ObjectRoot) -> None:
    scheme, _, rest = object_root.root.partition("://")
    missing = f"{scheme}://nosuch-{uuid.uuid4().hex[:8]}/{rest.partition('/')[2]}"
    # a mistyped bucket must not look like a run with no steps yet (which would start from scratch)
    with pytest.raises(mmapckpt.CheckpointNotFoundError, match="no such"):
        mmapckpt.CheckpointManager(missing, storage_options=object_root.options).steps()
