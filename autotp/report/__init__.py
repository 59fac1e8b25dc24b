"""Reports on compiled graphs: per-node and per-layer tables, dumps, CUDA-graph regions."""
