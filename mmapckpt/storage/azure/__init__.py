"""Checkpoints on Azure Blob Storage (``az://CONTAINER/PREFIX``, also ``abfs://``): the ``azure`` extra.

Imported only when such a location is used (``storage/location.py``); see docs/object-storage.md.
"""

from .options import AzureOptions
from .storage import AzureStorage, BlobFile

__all__ = ["AzureStorage", "BlobFile", "AzureOptions"]
