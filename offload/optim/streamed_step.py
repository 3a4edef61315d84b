"""The third lane of the optimizer step: sub-groups whose state is homed on the host, stepped on the compute device.

[Note: the streamed lane] Where the optimizer state is offloaded to the host, the host's Adam alone sets the pace of
the step once backward is done (on an H200, 0.28 ns an element against 0.15 for the bus both ways). The device can
step part of that state instead: each such sub-group's state (``offload.stream_state``: the units the next forward
needs first, placed in sub-groups of their own) is read up into a device slot on a copy stream of its own, Adam
runs there in torch's kernels on the compute stream (the same update as a device-resident unit's: see [Note: Adam
on a discrete device] in offload/optim/adam.py), and the new state goes back down into its host home on a second
copy stream, with the new weights: into the device home, or down into a host home, whose next reader waits for
that copy as it waits for an early step's. The units' gradients stay on the device, as a device-stepped unit's do
(``StateSplit.streamed``), so the norm and clipping see them where the device lane's are. Two device slots take
turns: the read of the next sub-group overlaps the step and the copy back of this one, and a slot is read into
again only after its own last copy back has run (each slot's event: waiting for the other slot's as well made the
reads and the copies back take turns, up, step, down, up, as the recorded step showed). Everything that reads
the host state otherwise (checkpoints, the refit) drains the optimizer, which waits for the copies back
(``settle``). On a CPU compute device the host's memory is the device's: there is nothing to stream, and the
placement streams nothing there.
"""

from __future__ import annotations

import torch

from offload.machine.accelerator import Accelerator, Event
from offload.observe.telemetry import Telemetry
from offload.optim.adam import AdamHyper
from offload.optim.shard_state import ShardPhase, ShardState
from offload.optim.update import ShardUpdate
from offload.store.param_store import ParamStore
from offload.store.sub_groups import SubGroup
from offload.store.tier import Tier


class StreamedStep:
    """The streamed sub-groups' step: their two device slots, the copy streams each way, and the last copy back."""

    def __init__(self, accel: Accelerator, update: ShardUpdate, params: ParamStore, shards: dict[int, ShardState],
                 groups: list[SubGroup], telemetry: Telemetry) -> None:
        """``groups``: the streamed sub-groups (homed on the host); the slots fit the largest."""
        self.accel, self.update, self.params, self.shards, self.telemetry = accel, update, params, shards, telemetry
        self.up = accel.copy_stream("state-h2d")
        self.down = accel.copy_stream("state-d2h")
        self.slot_bytes = max(g.fmt.slot_bytes(g.numel) for g in groups)
        self._slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=accel.device) for _ in range(2)]
        self._turn = 0
        self._back: list[Event | None] = [None, None]  # each slot's last copy back of state and weights
        self._last: Event | None = None  # the last copy back of either (what ``settle`` waits for)
        self._step = 0  # the step whose sub-groups are being streamed

    @property
    def device_bytes(self) -> int:
        return 2 * self.slot_bytes

    def step(self, group: SubGroup, step: int, hypers: list[AdamHyper], grad_scale: float) -> None:
        """One streamed sub-group's Adam: its state read up, stepped on the compute stream, and written back with
        its units' new weights (see [Note: the streamed lane]); returns once it is enqueued."""
        host = group.resident
        assert group.streamed and host is not None, f"sub-group {group.index} is not streamed"
        turn = self._turn
        device = group.fmt.slot(self._slots[turn], group.numel)
        self._turn ^= 1
        back = self._back[turn]
        if step != self._step and self._last is not None:  # a step's first read: after the last step's copies
            self.up.wait_event(self._last)  # back (a sub-group may take the other slot than it did then)
        self._step = step
        if back is not None:  # this slot's last copy back has run: it may be written again
            self.up.wait_event(back)
        nbytes, unit, graph = group.fmt.slot_bytes(group.numel), group.members[0].unit, self.accel.graph

        def up() -> None:
            graph.work("h2d", unit, nbytes=nbytes)  # the recorded step's (offload/observe/step_graph.py)
            device.copy_(host, non_blocking=True)

        def down() -> None:
            graph.work("d2h", unit, nbytes=nbytes)
            host.copy_(device, non_blocking=True)
        self.up.run(up)
        self.telemetry.add_bytes("state_h2d", nbytes)
        self.accel.compute_wait(self.up.record())
        for member in group.members:
            assert self.shards[member.unit].phase is not ShardPhase.STEPPED, member.unit  # never stepped early
            self.update.step_shard(member.unit, device.narrow(member.offset, member.numel), step, hypers, grad_scale,
                                   publish=False)
        self.down.wait_event(self.update.after_compute())
        self.down.run(down)
        self.telemetry.add_bytes("state_d2h", nbytes)
        for member in group.members:
            weights = device.narrow(member.offset, member.numel).master
            if self.params.home(member.unit) is Tier.DEVICE:
                self.params.write_device(member.unit, weights)
            else:
                self.params.write_down(member.unit, weights, self.down)
        self._back[turn] = self._last = self.down.record(into=back)

    def settle(self) -> None:
        """Block until every copy back has run: the host state (and host-homed weights) are the step's."""
        if self._last is not None:  # the copy stream runs its copies in order: the last is after every other
            self.accel.wait(self._last, "the streamed state's copy back")
