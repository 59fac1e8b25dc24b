"""Reports on compiled graphs: per-node and per-layer tables, dumps, CUDA-graph regions."""

DUMP_FORMATS = ("code", "dot", "svg", "json")
"""What ``autotp.report.dump.write`` writes (here, so the command line lists them without importing torch)."""
