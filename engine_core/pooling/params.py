"""What one pooling request asks for (no torch: the API and tokenizer processes build these)."""

from __future__ import annotations

import msgspec

from pagoda.engine_core.validation import ParamError

TASKS = ("embed", "token_embed")


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """`task`: "embed" pools the prompt into one vector (the model's pooling and normalization);
    "token_embed" returns every prompt token's final hidden state, as they are. `dimensions`: keep the
    first d of an embedding's values (Matryoshka models only), renormalized when the model normalizes.
    `normalize`: override the model's own choice (None keeps it). `batch_id`: the client request this
    input is one of (the tokenizer process sets it, overriding a client's): the engine's scheduler lets
    client requests take turns (engine_core/pooling/scheduler.py); None = a batch of its own."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    batch_id: str | None = None

    def validate(self, hidden_size: int, matryoshka: bool, matryoshka_dimensions: list[int] | None) -> None:
        """ParamError naming the field, for what this model cannot do."""
        if self.task not in TASKS:
            raise ParamError(f"Invalid 'task': expected one of {', '.join(TASKS)}, got {self.task!r}.", "task")
        if self.dimensions is None:
            return
        if not matryoshka:
            raise ParamError(
                "Invalid 'dimensions': this model does not support Matryoshka embeddings (its config declares "
                "no `is_matryoshka` or `matryoshka_dimensions`), so its embeddings cannot be shortened.",
                "dimensions",
            )
        if self.task != "embed":
            raise ParamError("Invalid 'dimensions': it applies to pooled embeddings only.", "dimensions")
        if not 1 <= self.dimensions <= hidden_size:
            raise ParamError(
                f"Invalid 'dimensions': expected a value in [1, {hidden_size}], got {self.dimensions}.", "dimensions"
            )
        if matryoshka_dimensions and self.dimensions not in matryoshka_dimensions:
            raise ParamError(
                f"Invalid 'dimensions': this model supports {', '.join(map(str, matryoshka_dimensions))}, "
                f"got {self.dimensions}.",
                "dimensions",
            )
