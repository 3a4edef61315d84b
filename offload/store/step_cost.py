"""A step's time from rates: the one model that `auto`'s split is chosen by and `offload estimate` prints.

[Note: the step as lanes] A step of one rank is made of terms, each the bytes or FLOPs of one stage over the rate
of what runs it: the model's compute and the device Adam (the GPU), the host Adam (host memory, and the disk for
state on NVMe), the parameter shards brought up from the host (pinned host to device) and the gradients sent down
(device to host). State streamed (homed on the host, stepped on the device: [Note: the streamed lane] in
offload/optim/streamed_step.py) adds to the device Adam and crosses the bus both ways: its state up; its state, and
for a host home its new weights, down; homed on NVMe, its state is read and written by the step's disk pass (in
the host Adam's term, the disk's lane) and its new weights are written on the host. The terms that share a
resource run one after another on it, so they form a lane: the GPU's is compute plus the device Adam; each bus
direction's is its copies (parameters and state up; gradients and state down); the host Adam is a lane alone.
Where every stage overlaps the step is its longest lane (the floor); where they run one after another, the sum of
the terms. A split is chosen for the shortest longest lane, and of splits within ``TIE`` of it, for the shortest
sum: the max is what an overlapped step reaches, the sum what it falls back to where an overlap fails, and the
second never buys the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from offload.store.tier import Tier

ADAM_BYTES = 28  # per element of one Adam step: fp32 master, moments and gradient read, master and moments written
NVME_BYTES = 24  # per element on the disk: master and moments read, and written to the other slot
STATE_BYTES = 12  # per element of fp32 state (master and moments); fewer in another format (state_format.py)


def adam_bytes(state_bytes: int = STATE_BYTES) -> int:
    """Host memory an element of one Adam step moves: its state read and written, the fp32 gradient read."""
    return 2 * state_bytes + ADAM_BYTES - 2 * STATE_BYTES


C = TypeVar("C")  # what a candidate split is named by
TIE = 0.01  # lanes this close (relative) are equal, and the serial sum decides


@dataclass(frozen=True)
class Rates:
    """What a step's stages run at, each None where not known (a term it prices is then unknown)."""

    compute_ms: float | None = None  # forward and backward of one step on the device
    device_gbps: float | None = None  # device memory, as the device Adam streams it
    host_gbps: float | None = None  # host memory, as the host Adam streams it (`offload bench adam`)
    nvme_gbps: float | None = None  # the swap path, reads and writes together (`offload tune-nvme`)
    h2d_gbps: float | None = None  # pinned host -> device (`offload bench pcie`)
    d2h_gbps: float | None = None

    @property
    def prices_a_split(self) -> bool:
        """Whether these rates price every term a split of host-stepped state changes (else a split is chosen state
        first): the device's and the host's Adam, and the bus each way."""
        return all(r for r in (self.device_gbps, self.host_gbps, self.h2d_gbps, self.d2h_gbps))


@dataclass(frozen=True)
class Traffic:
    """What one step of one rank moves, in elements (see [Note: the step as lanes])."""

    stepped: dict[Tier, int]  # optimizer elements stepped, by the tier their state lives on
    gathered_up: int  # shard elements brought up from the host for each forward's gather, and again each backward's
    copied_up: int  # device-homed shards stepped off the device: each new shard is copied up once a step
    item: int  # bytes of an element in the compute dtype
    micro_batches: int = 1  # forwards and backwards a step: each gathers, each sends its gradients down
    grads_accumulated_on_device: bool = False  # several micro-batches' gradients sent down once, in fp32
    state_bytes: int = STATE_BYTES  # bytes an element of optimizer state (its format's)
    streamed: int = 0  # elements whose state is homed on the host and stepped on the device (not in ``stepped``)
    streamed_down: int = 0  # of those, elements whose new weights go down to a host home (not up for the forward)
    streamed_nvme: int = 0  # of those, elements whose state the step's pass reads from NVMe and writes back there


def adam_ms(tier: Tier, numel: int, item: int, rates: Rates, state_bytes: int = STATE_BYTES,
            passed: int = 0) -> float | None:
    """One step's Adam over ``numel`` elements whose state (``state_bytes`` an element) lives on ``tier``: its
    memory traffic (and on NVMe its disk's, whichever is longer: they overlap; the disk's pass also carries the
    state of ``passed`` more elements, streamed through the device); None without the rate."""
    rate = rates.device_gbps if tier is Tier.DEVICE else rates.host_gbps
    times = [numel * (adam_bytes(state_bytes) + item) / (rate * 1e9) * 1e3] if rate else []
    if tier is Tier.NVME:
        if not rates.nvme_gbps:
            return None
        times.append((numel + passed) * 2 * state_bytes / (rates.nvme_gbps * 1e9) * 1e3)
    return max(times) if times else None


@dataclass
class StepPrediction:
    """A step's terms in ms (None: a rate unknown), the lanes they form, and the step they make (the longest lane
    where every stage overlaps, the floor; the sum where they run one after another)."""

    terms: dict[str, float | None]

    def _known(self) -> bool:
        return bool(self.terms) and all(t is not None for t in self.terms.values())

    @property
    def lanes(self) -> dict[str, float] | None:
        """The terms that share a resource summed (the GPU's compute and device Adam), None where one is unknown."""
        return _lanes(self.terms) if self._known() else None

    @property
    def overlapped_ms(self) -> float | None:
        lanes = self.lanes
        return max(lanes.values()) if lanes else None

    @property
    def serial_ms(self) -> float | None:
        return sum(v or 0.0 for v in self.terms.values()) if self._known() else None

    def terms_text(self, skip: tuple[str, ...] = ()) -> str:
        return ", ".join(f"{k} {'?' if v is None else f'{v:,.0f} ms'}" for k, v in self.terms.items()
                         if k not in skip)

    def note(self, source: str) -> str:
        terms = self.terms_text()
        lanes = self.lanes
        if lanes is None:
            return f"the step's terms: {terms} (a term without its rate or the model's shape is unknown)"
        slowest = max(lanes, key=lanes.__getitem__)
        return (f"the step predicted: {terms}; overlapped {max(lanes.values()):,.0f} ms (the {slowest}), one after "
                f"another {self.serial_ms:,.0f} ms" + (f", at {source}" if source else ""))


BUSES = (("host to device", ("parameters up", "state up")), ("device to host", ("gradients down", "state down")))


def _lanes(terms: dict[str, float | None]) -> dict[str, float]:
    t = {k: v or 0.0 for k, v in terms.items()}
    lanes = {"GPU (compute + device Adam)": t.pop("compute", 0.0) + t.pop("device Adam", 0.0)}
    for bus, parts in BUSES:  # one direction's copies queue behind each other
        present = [p for p in parts if p in t]
        if len(present) > 1:
            lanes[f"{bus} ({' + '.join(present)})"] = sum(t.pop(p) for p in present)
    return lanes | t


def predict(traffic: Traffic, rates: Rates) -> StepPrediction:
    """The terms of a step that moves ``traffic`` at ``rates`` (see [Note: the step as lanes])."""
    item = traffic.item
    on_device = traffic.stepped.get(Tier.DEVICE, 0) + traffic.streamed
    host_stepped = sum(n for tier, n in traffic.stepped.items() if tier is not Tier.DEVICE)
    host_adam: float | None = 0.0
    for tier in (Tier.HOST, Tier.NVME):
        passed = traffic.streamed_nvme if tier is Tier.NVME else 0  # the NVMe pass reads and writes theirs too
        if traffic.stepped.get(tier) or passed:
            ms = adam_ms(tier, traffic.stepped.get(tier, 0), item, rates, traffic.state_bytes, passed)
            host_adam = None if ms is None or host_adam is None else host_adam + ms
    terms: dict[str, float | None] = {
        "compute": rates.compute_ms,
        "host Adam": host_adam,
        "device Adam": adam_ms(Tier.DEVICE, on_device, item, rates, traffic.state_bytes) if on_device else 0.0}
    micro = traffic.micro_batches
    # a streamed unit's new weights are handed to the forward's gather on the device (offload/store/param_store.py)
    up = item * (2 * micro * traffic.gathered_up + traffic.copied_up - traffic.streamed_down)
    if up:
        terms["parameters up"] = up / (rates.h2d_gbps * 1e9) * 1e3 if rates.h2d_gbps else None
    if host_stepped:
        down = 4 * host_stepped if micro > 1 and traffic.grads_accumulated_on_device else item * micro * host_stepped
        terms["gradients down"] = down / (rates.d2h_gbps * 1e9) * 1e3 if rates.d2h_gbps else None
    if traffic.streamed:
        state = traffic.state_bytes * traffic.streamed
        terms["state up"] = state / (rates.h2d_gbps * 1e9) * 1e3 if rates.h2d_gbps else None
        down = state + item * traffic.streamed_down
        terms["state down"] = down / (rates.d2h_gbps * 1e9) * 1e3 if rates.d2h_gbps else None
    return StepPrediction(terms)


def sort_key(prediction: StepPrediction) -> tuple[float, float]:
    """What a split is chosen by: the longest lane, then the sum. The compute is the one term that may be unknown
    there (at start-up: the batch is not known yet), and counts as nothing: it is the same for every split."""
    unknown = [k for k, v in prediction.terms.items() if v is None and k != "compute"]
    assert not unknown, f"a split priced without the rate of {unknown}"  # Rates.prices_a_split holds this
    lanes = _lanes(prediction.terms)
    return max(lanes.values()), sum(lanes.values())


def best(candidates: list[tuple[StepPrediction, C]]) -> C:
    """Of (prediction, choice) pairs, the choice whose longest lane is shortest, of those within ``TIE`` of it the
    one whose sum is; the first such where they tie."""
    keys = [(sort_key(p), c) for p, c in candidates]
    floor = min(k[0] for k, _ in keys)
    near = [(k, c) for k, c in keys if k[0] <= floor * (1 + TIE)]
    return min(near, key=lambda kc: kc[0][1])[1]
