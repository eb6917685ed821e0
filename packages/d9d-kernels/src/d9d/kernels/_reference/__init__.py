"""Plain PyTorch implementations of every op: the ground truth and the CPU path."""
