"""Checkpoints on Google Cloud Storage (``gs://BUCKET/PREFIX``): the ``gcs`` extra (google-cloud-storage).

Imported only when such a location is used (``storage/location.py``); see docs/object-storage.md.
"""

from .options import GCSOptions
from .storage import GCSFile, GCSStorage

__all__ = ["GCSStorage", "GCSFile", "GCSOptions"]
