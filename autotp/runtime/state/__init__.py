"""Where each tensor lives: parameter shards (the shard map), expert shards, checkpoints (DCP, Hugging Face) and export, materializing meta models."""
