"""Triton GPU kernels, drop-in replacements (same signatures) for the torch references in `pagoda.kernels.torch_ref`."""
