"""Gradients across ranks: the one gradient-sync interface and its implementations, the DistributedOptimizer's buffers, global norms."""
