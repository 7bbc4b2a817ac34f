"""A kvmesh command whose main thread (the event loop's) is profiled in windows its bench
chooses, so start-up is never measured: SIGUSR1 starts a window, SIGUSR2 ends it and writes
its pstats to OUT (whole, by rename). The profile's timer is the thread's CPU time, so a
function's own time is CPU it spent, not time it waited.

    python -m kvmesh.cli.profiled OUT router --model ... (any kvmesh command)
"""

from __future__ import annotations

import cProfile
import os
import signal
import sys
import time

from kvmesh.cli.main import main as kvmesh_main


def main(out: str, argv: list[str]) -> int:
    window: list[cProfile.Profile] = []

    def start(*_) -> None:
        window[:] = [cProfile.Profile(time.thread_time)]
        window[0].enable()

    def stop(*_) -> None:
        if window:
            window[0].disable()
            window[0].dump_stats(out + ".part")
            os.replace(out + ".part", out)
            window.clear()

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    return kvmesh_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
