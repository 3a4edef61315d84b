"""A step as a graph: what ran on which stream or thread, after what.

[Note: recorded step graph] A GPU is lent rarely, yet each change to the step's pipeline
should show its effect on one before it is lent. The emulated streams (see [Note: emulated
streams] in accelerator.py) already run the engine's GPU code path on a CPU, in the order a
GPU would; while a ``StepGraph`` records, every piece of that work leaves an item on its
lane: the compute stream (a unit's forward or backward, a gather or reduce there), a copy
stream (an H2D or D2H copy of so many bytes), a host thread (a hook's Python, a gradient's
accumulation, a shard's Adam, a blocking wait). Items carry what orders them across lanes:
the record of an event (``record``), waits for one (``waits``), and the point of the lane
that issued them (``issued``: a copy cannot start before the host thread enqueued it). A
lane is in program order, so the items of one lane plus those three links are the whole
dependency graph; ``offload.bench.replay`` times it on a described machine.

Only the shape is recorded (bytes, element counts, FLOPs), never a CPU duration: the
durations come from the machine the replay describes. Recording is off unless a caller
turns it on, and costs one attribute test per site when off.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HOST = "host"  # the training thread and autograd's: one lane (they take turns)
COMPUTE = "compute"  # the compute stream

# Kinds of item, by what the replay charges them.
COMPUTE_KINDS = ("forward", "backward")  # FLOPs at the device's rate
DEVICE_COPY_KINDS = ("gather", "reduce")  # bytes through device memory (W = 1) or the link between ranks
COPY_KINDS = ("h2d", "d2h")  # bytes over PCIe, one direction each
HOST_MEMORY_KINDS = ("adam", "accumulate", "norm")  # bytes through host memory
HOOK_KINDS = ("hook_forward", "hook_backward", "hook_step")  # one call's host time
MARKERS = ("record", "wait", "mark")  # cost nothing: they order, or label a point
KINDS = COMPUTE_KINDS + DEVICE_COPY_KINDS + COPY_KINDS + HOST_MEMORY_KINDS + HOOK_KINDS + MARKERS


@dataclass
class Item:
    """One piece of work, or an ordering point, on one lane."""

    kind: str
    unit: int | None = None
    nbytes: int = 0
    flops: float = 0.0
    record: int | None = None  # this point completes record ``record`` of some event
    waits: list[int] = field(default_factory=list)  # records to wait for before starting
    issued: tuple[str, int] | None = None  # (lane, n): not before that lane's first n items are done
    label: str = ""


_local = threading.local()


def set_lane(name: str) -> None:
    """The calling thread's work belongs to lane ``name`` (a stream's worker says which it emulates)."""
    _local.lane = name


def current_lane() -> str:
    return getattr(_local, "lane", HOST)


class StepGraph:
    """The recorder: lanes of items, appended by whichever thread does the work; thread-safe."""

    def __init__(self) -> None:
        self.on = False
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.lanes: dict[str, list[Item]] = {}
        self.lane_kinds: dict[str, str] = {HOST: "host", COMPUTE: "device"}
        self.meta: dict[str, Any] = {}
        self._flops: Callable[[], float] | None = None  # FLOPs the training thread ran so far (a counter's)
        self._flops_seen = 0.0
        self._phase = "forward"

    # ----------------------------------------------------------------- control

    def start(self, flops: Callable[[], float] | None = None, **meta: Any) -> None:
        """Begin a recording (an earlier one is dropped); ``meta`` goes into the file as it is. ``flops``: the
        FLOPs the training thread has run so far (a ``torch.utils.flop_counter.FlopCounterMode``'s total): what
        it ran between two recorded points becomes one compute item between them."""
        with self._lock:
            self.lanes = {HOST: [], COMPUTE: []}
            self.meta = dict(meta)
            self._flops = flops
            self._flops_seen = flops() if flops is not None else 0.0
            self.on = True

    def stop(self) -> None:
        self.on = False

    def declare(self, lane: str, kind: str) -> None:
        """Lane ``lane`` is a ``kind`` ("copy": a copy stream, "host": a host thread, "device")."""
        self.lane_kinds[lane] = kind

    # ----------------------------------------------------------------- what the engine calls

    def issue_point(self) -> tuple[str, int]:
        """Where the calling thread is now: work it enqueues elsewhere cannot start before this point."""
        lane = current_lane()
        with self._lock:
            return lane, len(self.lanes.setdefault(lane, []))

    def new_record(self, event: object) -> int:
        """A new record of ``event``: its id, kept on the event so a later wait names the latest record."""
        rid = next(self._ids)
        event._graph_record = rid  # type: ignore[attr-defined]
        return rid

    @staticmethod
    def record_of(event: object) -> int | None:
        return getattr(event, "_graph_record", None)

    def add(self, item: Item, lane: str | None = None) -> None:
        """Append ``item`` to ``lane`` (default: the calling thread's). Work put on another lane than the
        caller's is issued at the caller's present point; work run by a stream's worker at the point the
        worker was given with it."""
        own = current_lane()
        lane = lane or own
        if own == HOST and lane in (HOST, COMPUTE) and self._flops is not None:
            self._flush_compute()
        with self._lock:
            if item.issued is None:
                if lane != own:
                    item.issued = (own, len(self.lanes.setdefault(own, [])))
                else:
                    item.issued = getattr(_local, "issued", None)
            self.lanes.setdefault(lane, []).append(item)

    def _flush_compute(self) -> None:
        """The training thread's compute since its last recorded point, as one item on the compute stream."""
        total = self._flops()  # type: ignore[misc]
        if total > self._flops_seen:
            with self._lock:
                item = Item(self._phase, flops=total - self._flops_seen, issued=(HOST, len(self.lanes[HOST])))
                self.lanes[COMPUTE].append(item)
            self._flops_seen = total

    def work(self, kind: str, unit: int | None = None, nbytes: int = 0, flops: float = 0.0,
             lane: str | None = None) -> None:
        if self.on:
            self.add(Item(kind, unit, nbytes=nbytes, flops=flops), lane)

    def wait(self, event: object, lane: str | None = None) -> None:
        """The lane (default: the caller's) waits here for ``event``'s latest record (if recorded at all)."""
        if self.on:
            rid = self.record_of(event)
            self.add(Item("wait", waits=[rid] if rid is not None else []), lane)

    def mark(self, label: str) -> None:
        """A labelled point on the host lane (a step's start)."""
        if self.on:
            self.add(Item("mark", label=label), HOST)
            if label in ("forward", "backward"):
                self._phase = label

    # ----------------------------------------------------------------- file

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            lanes = {name: [_compact(asdict(item)) for item in items] for name, items in self.lanes.items() if items}
            return {"format": "offload-schedule/1", "meta": self.meta,
                    "lane_kinds": {k: v for k, v in self.lane_kinds.items() if k in lanes}, "lanes": lanes}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json()))


class running_as:
    """Within the block the calling (worker) thread's work was issued at ``issued``."""

    def __init__(self, issued: tuple[str, int] | None) -> None:
        self.issued = issued

    def __enter__(self) -> None:
        self.previous = getattr(_local, "issued", None)
        _local.issued = self.issued

    def __exit__(self, *exc: object) -> None:
        _local.issued = self.previous


def _compact(row: dict[str, Any]) -> dict[str, Any]:
    """Drop fields at their defaults: a step graph has tens of thousands of items."""
    defaults: dict[str, Any] = {"unit": None, "nbytes": 0, "flops": 0.0, "record": None, "waits": [], "issued": None,
                                "label": ""}
    return {k: v for k, v in row.items() if k == "kind" or v != defaults[k]}


def load(path: Path) -> dict[str, Any]:
    """A step graph's file, checked for its format."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}): give a schedule written by `offload bench schedule`") from None
    if not isinstance(data, dict) or data.get("format") != "offload-schedule/1":
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path} is not a schedule recorded by offload (format {found!r}, "
                         f"expected 'offload-schedule/1'): record one with `offload bench schedule`")
    return data
