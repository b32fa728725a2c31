"""What a peer's driver tells ``bench`` while it runs: its phase and the workload's tokens done so far.

Written to the file the job names (``job["progress"]``), replaced whole at most
once a second; the parent (:func:`minivllm.bench.peers.run_peer`) reads it for
its progress line. Plain Python: it runs in the peer's environment.
"""

import os
import time


class Progress:
    def __init__(self, path):
        self.path, self.last = path, -1.0

    def __call__(self, phase, done=0, force=False):
        t = time.perf_counter()
        if not self.path or (not force and t - self.last < 1.0):
            return
        self.last = t
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{phase}\t{done}")
        os.replace(tmp, self.path)
