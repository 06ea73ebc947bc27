"""Which pipeline stage a process runs. Both the group set-up (engine_core/parallel/distributed.py) and the link
between the stages (engine_core/parallel/pipeline.py) hold one."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine_core.parallel.sharding import split_rows


@dataclass(frozen=True)
class Stage:
    """Which pipeline stage a process runs: its contiguous share of the model's layers. The first stage
    also holds the embedding and the LM head (so rank 0 samples without receiving logits); the last the
    final norm. `WHOLE` is the whole model."""

    index: int = 0
    count: int = 1

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def layers(self, num_layers: int, head_cost: float = 0.0) -> range:
        """This stage's layers. `head_cost`: what the first stage's LM head (and sampling) costs, in
        layers; the first stage gets that many fewer layers, so that every stage has as much work (a
        decode step reads every weight once, so the cost of a layer or of the head is its weights). The
        other stages share the rest evenly (differing by one layer at most); every stage gets one at
        least."""
        first = round((num_layers + head_cost) / self.count - head_cost)
        first = max(1, min(first, num_layers - (self.count - 1)))
        if self.is_first:
            return range(first)
        span = split_rows(num_layers - first, self.index - 1, self.count - 1)
        return range(first + span.start, first + span.stop)


WHOLE = Stage()
