"""Runtime: ParallelModel, process groups, collective kernels, pipeline runner, grad sync,
CUDA-graph capture, RNG and the launcher."""
