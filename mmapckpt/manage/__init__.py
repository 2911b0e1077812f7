"""Managed checkpoints of a training run: numbered steps under one root, retention, leases, resume.

``manager`` (``CheckpointManager``, exported by the face) over ``retention`` (which steps stay,
and removing the others), ``leases`` (a load keeps its step), ``collective`` (the ranks agree on
the coordinator's decision) and ``root`` (the layout: marker, step directories, listing);
``describe`` is ``mmapckpt inspect ROOT``. docs/manager.md.
"""
