"""The progress file both peer drivers write (chapter 11): run from this folder by the peers' own pythons, so
``from _progress import Progress`` finds it beside them (the script's folder is first on ``sys.path``)."""

import os
import time


class Progress:
    """What ``bench`` shows while this runs: the phase and the workload's tokens done so far, in the file the job
    names (``job["progress"]``), replaced whole at most once a second (minivllm.bench.peers.run_driver reads it)."""

    def __init__(self, path):
        self.path, self.last = path, -1.0

    def __call__(self, phase, done=0, force=False):
        t = time.perf_counter()
        if not self.path or (not force and t - self.last < 1.0):
            return
        self.last = t
        with open(f"{self.path}.tmp", "w") as f:
            f.write(f"{phase}\t{done}")
        os.replace(f"{self.path}.tmp", self.path)
