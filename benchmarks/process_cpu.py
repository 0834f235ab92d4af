"""CPU seconds of a server's processes (the launcher with the API, and the actors it
started, named troupe-*), read from /proc: what each spends while a benchmark loads it."""

from __future__ import annotations

import os


def _stat(pid: str) -> tuple[str, int, float] | None:
    """(name, parent pid, CPU seconds) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return stat[stat.index("(") + 1: stat.rindex(")")], int(fields[1]), \
        (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(root_pid: int) -> dict[tuple[int, str], float]:
    """(pid, name) -> CPU seconds (user + system) of root_pid (named "the API server") and
    every process below it."""
    stats = {int(pid): stat for pid in os.listdir("/proc") if pid.isdigit() and (stat := _stat(pid))}
    tree, grew = {root_pid}, True
    while grew:
        below = {pid for pid, (_, parent, _) in stats.items() if parent in tree} - tree
        tree |= below
        grew = bool(below)
    return {(pid, "the API server" if pid == root_pid else stats[pid][0]): stats[pid][2]
            for pid in tree if pid in stats}


def busy_by_name(before: dict[tuple[int, str], float], after: dict[tuple[int, str], float]) -> dict[str, float]:
    """CPU seconds spent between two cpu_seconds() readings, by process name (input processors share one)."""
    busy: dict[str, float] = {}
    for key, seconds in after.items():
        busy[key[1]] = busy.get(key[1], 0.0) + seconds - before.get(key, 0.0)
    return busy
