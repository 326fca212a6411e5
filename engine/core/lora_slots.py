"""Which LoRA adapter holds each of the device's `max_loras` slots. Pure logic: no torch.

A running row pins its adapter's slot. A row whose adapter holds no slot takes a free one, or
evicts the least recently used adapter that no running row pins; when every slot is pinned by
other adapters the row waits (the scheduler admits it in a later wave), so no request ever fails
for lack of a slot. Each slot given to a new adapter is queued as a load, which the engine
carries out (weights to the device) before the next forward pass."""
from __future__ import annotations


class LoRASlots:
    """Slot ownership, pins and recency for up to `num_slots` resident adapters."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.owner: list[int | None] = [None] * num_slots
        """lora_int_id of the adapter in each slot (None: empty)."""
        self.pins = [0] * num_slots
        """Running rows using each slot."""
        self.used = [0] * num_slots
        self._clock = 0
        self.loads: list[tuple[int, object]] = []
        """(slot, LoRARequest) to load before the next pass, in order."""
        self.evictions = 0

    def slot_of(self, lora_int_id: int) -> int | None:
        return self.owner.index(lora_int_id) if lora_int_id in self.owner else None

    def acquire(self, request) -> int | None:
        """Pins a slot holding `request`'s adapter (a LoRARequest), loading it into a free or evicted
        slot if needed; None when every slot is pinned by another adapter."""
        slot = self.slot_of(request.lora_int_id)
        if slot is None:
            free = [s for s in range(self.num_slots) if self.owner[s] is None]
            idle = [s for s in range(self.num_slots) if self.pins[s] == 0]
            if not free and not idle:
                return None
            slot = free[0] if free else min(idle, key=lambda s: self.used[s])
            if self.owner[slot] is not None:
                self.evictions += 1
            self.owner[slot] = request.lora_int_id
            self.loads.append((slot, request))
        self.pins[slot] += 1
        self._touch(slot)
        return slot

    def release(self, slot: int) -> None:
        """A row using `slot` left (finished, preempted, aborted)."""
        self.pins[slot] -= 1
        self._touch(slot)

    def take_loads(self) -> list[tuple[int, object]]:
        loads, self.loads = self.loads, []
        return loads

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self.used[slot] = self._clock
