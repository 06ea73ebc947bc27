"""Running one model over several processes: the tensor-parallel group, how each layer is split over it,
the worker processes that hold ranks 1..N-1, and the shared-memory ring that carries each step's inputs
to them (docs/parallel.md)."""
