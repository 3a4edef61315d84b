"""The step as gradients land: each shard's Adam on the landing worker right after its last gradient is in (see
[Note: overlapped step] in offload/optim/sharded.py), or its speculative Adam handed to the speculation where the
factor is guessed; an NVMe sub-group once every one of its units' gradients is in, in the store's pass order (see
[Note: NVMe sub-groups stepped during backward] in offload/store/optimizer_state.py). The landing calls it as each
gradient lands (``landed``); the optimizer takes the failure it kept (``take_error``)."""

from __future__ import annotations

from offload.observe.telemetry import Telemetry
from offload.optim.hyper import Hyper
from offload.optim.shard_state import Overlap, ShardPhase, ShardState
from offload.optim.speculation import Speculation
from offload.optim.update import ShardUpdate
from offload.store.optimizer_state import OptimizerStateStore
from offload.store.param_store import ParamStore
from offload.store.state_format import StateSlot
from offload.store.tier import Tier


class OverlappedStep:
    """This rank's shards stepped inside the last micro-batch's backward, as their gradients land."""

    def __init__(self, shards: dict[int, ShardState], store: OptimizerStateStore, update: ShardUpdate,
                 params: ParamStore, speculation: Speculation, telemetry: Telemetry) -> None:
        self.shards, self.store, self.update, self.params = shards, store, update, params
        self.speculation, self.telemetry = speculation, telemetry
        self.error: BaseException | None = None  # an NVMe transfer failed during backward: engine.step() raises it

    def landed(self, index: int, overlap: Overlap | None) -> None:
        """On the landing worker, right after unit ``index``'s gradient was accumulated (``overlap``: the plan of
        the backward it came from). A host shard steps at once; an NVMe sub-group once all of its units' gradients
        are in."""
        if overlap is None or index not in overlap.units:
            return
        hypers, step = overlap.hypers, overlap.step
        group, member = self.store.place(index)
        if overlap.guess is not None and group.tier is not Tier.NVME:
            self.speculation.hand_over(index, group, member, overlap)
            return
        if group.tier is not Tier.NVME:
            self._step(index, group.views(member), hypers, step)
            return
        if self.error is not None:
            return
        try:
            for ready in self.store.arrive(index):
                for m in ready.members:
                    if overlap.guess is not None:  # in the read buffer: the file's current slot stays intact
                        self.speculation.in_place(m.unit, ready.views(m), overlap)
                    else:
                        self._step(m.unit, ready.views(m), hypers, step)
        except Exception as e:  # noqa: BLE001 - a failed transfer: engine.step() raises it, and can be retried
            self.error = e

    def _step(self, index: int, views: StateSlot, hypers: list[Hyper], step: int) -> None:
        state = self.shards[index]
        if state.phase is ShardPhase.STEPPED:  # a failed backward stepped it ([Note: shard phases], shard_state.py)
            return
        with self.telemetry.span("optimizer_overlapped", state.name):
            self.update.step_shard(index, views, step, hypers, 1.0)
        state.stepped()
        self.params.copy_back(index, after=None)

    def take_error(self) -> BaseException | None:
        """The NVMe failure of the last overlapped backward, if any; forgotten once taken."""
        error, self.error = self.error, None
        return error
