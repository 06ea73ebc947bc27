"""`LayeredCheck`: a fused CPU decode step checked against the layer-by-layer forward on the same inputs
(test_fused_decode.py; test_gemma.py checks that Gemma never takes the fused step)."""

from __future__ import annotations


class LayeredCheck:
    """Wraps a model's fused decoder: after each fused call, the layers run one by one on the same
    inputs, and both results are compared."""

    def __init__(self, model) -> None:
        self.model = model
        self.calls = 0
        self.batches: set[int] = set()
        self.worst = 0.0
        self._original = model.fused_decode.decoder_for

    def __enter__(self) -> LayeredCheck:
        def decoder_for(model, meta, hidden):
            fused = self._original(model, meta, hidden)
            if fused is None:
                return None

            def checked(positions, hidden, residual, *rest):
                out = fused(positions, hidden, residual, *rest)
                h, r = hidden.clone(), None if residual is None else residual.clone()
                for i in model.layer_range:
                    h, r = model.layers[i](positions, h, r, meta)
                for got, want in zip(out, (h, r), strict=True):
                    scale = want.abs().max().item() + 1e-6
                    self.worst = max(self.worst, (got - want).abs().max().item() / scale)
                self.calls += 1
                self.batches.add(hidden.shape[0])
                return out

            return checked

        self.model.fused_decode.decoder_for = decoder_for
        return self

    def __exit__(self, *exc) -> None:
        self.model.fused_decode.decoder_for = self._original
