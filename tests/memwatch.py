"""The peak of a process's anonymous resident memory over a block, sampled by a thread.

ru_maxrss and psutil's rss count file-backed pages too (the mapped pages of libtorch and
friends), which the kernel evicts and reloads under page-cache pressure from other work
on the machine: hundreds of MB of swing that no allocation caused. RssAnon counts only
memory that the process allocated.
"""

import threading
import time

from offload.machine.host_malloc import resident


def rss_anon() -> int:
    anon = resident().anon  # the library's reading of /proc/self/status
    if anon is None:
        raise RuntimeError("/proc/self/status has no RssAnon line")
    return anon


class AnonPeak:
    """``with AnonPeak() as p: ...`` then ``p.peak``: the most RssAnon seen inside (sampled every ms)."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.interval)

    def __enter__(self) -> "AnonPeak":
        self.peak = rss_anon()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())
