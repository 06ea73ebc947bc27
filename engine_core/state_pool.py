"""Recurrent-state slots: one per running request of a model with recurrent layers (Qwen3.5's Gated
DeltaNet), the recurrent group of the KV manager (DESIGN §7).

A linear-attention layer keeps a fixed-size state per sequence instead of K/V per token; the model runner
holds those states in pools of `num_slots + 1` rows per layer (engine_core/model_runner.py), and a request
holds one row in all of them while it runs. Slot 0 is nobody's: padding rows point there. A request takes a
slot when it is first scheduled and gives it back when it finishes, is aborted or is preempted (a
preempted request recomputes from its first token, so from a fresh state); a step that starts a request at
position 0 zeroes its slot first (the layer does, `fresh_states`), since a slot handed out again holds
its last owner's state.
"""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("a state pool needs at least one slot")
        self.num_slots = num_slots
        self._free = list(range(num_slots, 0, -1))  # (pop() hands out the lowest first)
        self._slot_of: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_slots

    def slot_of(self, request_id: str) -> int | None:
        return self._slot_of.get(request_id)

    def take(self, request_id: str) -> int | None:
        """The request's slot, taken now if it holds none; None if none is free."""
        slot = self._slot_of.get(request_id)
        if slot is None and self._free:
            slot = self._slot_of[request_id] = self._free.pop()
        return slot

    def give_back(self, request_id: str) -> None:
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_integrity(self) -> None:
        held = list(self._slot_of.values())
        assert len(set(held)) == len(held), "a state slot is held twice"
        assert sorted(held + self._free) == list(range(1, self.num_slots + 1)), "state slots leaked"
