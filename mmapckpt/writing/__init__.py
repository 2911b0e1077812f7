"""Writing checkpoints' files through the storage: the one shard writer."""
