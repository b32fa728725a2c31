"""Engine configuration and the one place the device is chosen (all chapters)."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """``cuda`` when a GPU is present, else ``cpu``: chosen once, used everywhere."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
