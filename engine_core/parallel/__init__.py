"""The parallel executors' building blocks."""
