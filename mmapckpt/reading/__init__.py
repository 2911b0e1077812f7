"""Reading checkpoints' files through the storage: shards, chunk backends, which format a path holds."""
