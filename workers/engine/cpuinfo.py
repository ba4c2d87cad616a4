"""What Linux says about the CPU in /proc/cpuinfo."""

from __future__ import annotations


def cpuinfo_field(name: str) -> str | None:
    """The value of the first ``name`` line (e.g. ``"flags"``, ``"model name"``); None where the
    file or the field is missing (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None
