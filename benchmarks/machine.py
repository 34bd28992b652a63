"""The machine and versions a speed report names (CPU model and vector extensions, cores,
memory, package versions)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


from benchmarks.common import VERSION_PACKAGES


# The CPU's vector extensions that decide how fast matrix products run (torch's oneDNN and
# XLA's CPU backend use what is there): two hosts with the same model name differed here.
VECTOR_EXTENSIONS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                     "amx_tile", "amx_bf16")


def cpu_facts(cpuinfo: str) -> tuple:
    """(model name, the VECTOR_EXTENSIONS among its flags) from /proc/cpuinfo's text."""
    cpu, flags = None, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and cpu is None:
            cpu = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return cpu, [x for x in VECTOR_EXTENSIONS if x in flags]


def extensions_text(machine: dict) -> str:
    found = machine.get("cpu_extensions") or []
    return ", ".join(found) if found else "none of " + ", ".join(VECTOR_EXTENSIONS)


def machine_facts() -> dict:
    cpu, extensions = None, []
    try:
        cpu, extensions = cpu_facts(Path("/proc/cpuinfo").read_text())
    except OSError:
        pass
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024 ** 3
    except (ValueError, OSError, AttributeError):
        ram = None
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return dict(cpu_model=cpu or platform.processor() or "unknown", cpu_extensions=extensions,
                cores=os.cpu_count(),
                cores_available=affinity, ram_gib=ram, platform=platform.platform(),
                load_average=os.getloadavg() if hasattr(os, "getloadavg") else None)


def versions() -> dict:
    from dpbench import numerics
    return numerics.versions(VERSION_PACKAGES)
