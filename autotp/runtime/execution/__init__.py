"""Running a rank program: the ParallelModel, its compiled signatures, the pipeline runner, CUDA-graph capture, overlapped collectives, the weight-gradient split, input guards and RNG."""
