"""Requests to adapters, on the engine's side: a request's adapter read and checked when it is
added, the device slots filled before each pass, and calls that run row groups (choice scoring,
pooling) run once per adapter, each group under its adapter's slot."""
from __future__ import annotations

from typing import Callable

from engine.api.errors import AdapterError, EngineBusy
from engine.api.lora import LoRARequest
from engine.core.lora_slots import LoRASlots
from engine.core.sequence import Sequence


class AdapterRouter:
    """The engine's LoRA bookkeeping over its runner (a ModelRunner with `lora` set, or without)."""

    def __init__(self, runner, max_loras: int, unavailable: str | None = None):
        self.runner = runner
        self.unavailable = unavailable
        """Why this engine takes no adapters (LoRA not enabled, an encoder), or None."""
        self.slots = LoRASlots(max_loras)
        self.active: tuple[int, bytes] | None = None
        """(slot, salt) the rows of a per-adapter call run under (None: the base model)."""

    def attach(self, seq: Sequence, request: LoRARequest | None) -> None:
        """Sets the adapter a new request runs under; AdapterError if it cannot be used."""
        if request is None:
            return
        seq.lora = request
        seq.lora_salt = self.digest(request)

    def digest(self, request: LoRARequest) -> bytes:
        if self.unavailable:
            raise AdapterError(f"adapter {request.lora_name}: {self.unavailable}")
        return self.runner.lora.read(request).digest

    def load_pending(self) -> None:
        """Installs the adapters the scheduler gave slots to since the last pass."""
        for slot, request in self.slots.take_loads():
            self.runner.load_lora(slot, request)

    def per_adapter(self, requests: list[LoRARequest | None], call: Callable[[list[int]], list],
                    failed: Callable[[str], object]) -> list:
        """Runs `call(indices)` once per adapter (the base model's rows first), each under its slot;
        returns one result per row in order. Rows of an adapter that cannot be used get `failed(message)`."""
        if not requests:  # the call's own checks still run (a model that cannot serve it is refused)
            return call([])
        groups: dict[int | None, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(None if r is None else r.lora_int_id, []).append(i)
        results: list = [None] * len(requests)
        for key, rows in sorted(groups.items(), key=lambda kv: kv[0] is not None):
            request = requests[rows[0]]
            if request is None:
                outs = call(rows)
            else:
                try:
                    salt = self.digest(request)
                except AdapterError as exc:
                    outs = [failed(str(exc))] * len(rows)
                else:
                    outs = self._under(request, salt, rows, call)
            for i, out in zip(rows, outs):
                results[i] = out
        return results

    def _under(self, request: LoRARequest, salt: bytes, rows: list[int], call) -> list:
        slot = self.slots.acquire(request)
        if slot is None:
            raise EngineBusy("every LoRA slot is held by running requests: drain them before scoring or pooling")
        try:
            self.load_pending()
            self.active = (slot, salt)
            return call(rows)
        finally:
            self.active = None
            self.slots.release(slot)

    def stamp(self, seq: Sequence) -> Sequence:
        """A row built by a per-adapter call runs under the call's adapter."""
        if self.active is not None:
            seq.lora_slot, seq.lora_salt = self.active
        return seq
