"""The hardware a replica names in its index record: routers price replicas on like hardware
alike, whichever engine runs there."""

from __future__ import annotations

import torch


def hardware_name(device: torch.device) -> str:
    """What the router groups replicas by when it prices them (``router/pricing.py``): the
    GPU's name, else the device type. Replicas on like hardware are priced alike. Printable
    ASCII and short: readers skip a record whose hardware is not (``kvcache/index/redis.py``)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return "".join(c if " " <= c <= "~" else "?" for c in name)[:64]
