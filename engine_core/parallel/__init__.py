"""Running one model over several processes: the tensor-parallel group, how each layer is split over it,
and the worker processes that hold ranks 1..N-1 (docs/parallel.md)."""
