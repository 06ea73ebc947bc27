"""Plain torch implementations of every kernel: the CPU path, and the reference the Triton kernels
are tested against."""
