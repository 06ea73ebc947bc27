"""Counters of speculative decoding, with vLLM's metric names (sent with every step's stats)."""

from __future__ import annotations

import logging
import time

from pagoda.engine_core.protocol import SpecDecodeStats

logger = logging.getLogger(__name__)
_LOG_EVERY_S = 10.0


class SpecDecodeCounters:
    def __init__(self, num_speculative_tokens: int):
        self.stats = SpecDecodeStats(0, 0, 0, [0] * num_speculative_tokens)
        self._logged_at = time.monotonic()
        self._logged = SpecDecodeStats(0, 0, 0, [0] * num_speculative_tokens)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_proposed` proposals held."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1

    def maybe_log(self) -> None:
        """Every 10 s with proposals: the acceptance rate and mean acceptance length since the last line."""
        now = time.monotonic()
        if now - self._logged_at < _LOG_EVERY_S:
            return
        drafts = self.stats.num_drafts - self._logged.num_drafts
        if drafts:
            proposed = self.stats.num_draft_tokens - self._logged.num_draft_tokens
            kept = self.stats.num_accepted_tokens - self._logged.num_accepted_tokens
            logger.info(
                "speculative decoding: %d of %d proposed tokens accepted (%.1f%%), mean acceptance length %.2f",
                kept,
                proposed,
                100.0 * kept / max(proposed, 1),
                1 + kept / drafts,  # tokens per verifying step and request, the target's own included
            )
        self._logged = SpecDecodeStats(
            self.stats.num_drafts,
            self.stats.num_draft_tokens,
            self.stats.num_accepted_tokens,
            list(self.stats.accepted_per_position),
        )
        self._logged_at = now
