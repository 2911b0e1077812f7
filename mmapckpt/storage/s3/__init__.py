"""Checkpoints on S3 and S3-compatible object stores (``s3://BUCKET/PREFIX``): the ``s3`` extra (boto3).

Imported only when an ``s3://`` location is used (``storage/location.py``); see
docs/object-storage.md.
"""

from .options import S3Options
from .storage import S3File, S3Storage, TransferStats

__all__ = ["S3Storage", "S3File", "S3Options", "TransferStats"]
