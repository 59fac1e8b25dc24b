"""Processes and their groups: the launcher, the process groups of every parallel axis, and the kernels of the registered ops that communicate over them."""
