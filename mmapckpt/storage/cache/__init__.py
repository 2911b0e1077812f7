"""A verified local cache of remote checkpoints' files (``storage_options={"cache_dir": DIR}``).

``storage/location.py`` ``storage_for`` wraps the storage of a URL in :class:`CachedStorage` where
the cache is asked for (settings.py); its files are then checked local copies (entry.py: fetched
once across processes, checked before they become visible, served only while the remote version
is the one cached), mapped like a local checkpoint's, within a size bound (evict.py).
docs/object-storage.md, "The local cache".
"""

from .settings import CacheSettings, split_options
from .storage import CachedStorage

__all__ = ["CachedStorage", "CacheSettings", "split_options"]
