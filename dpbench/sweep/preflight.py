"""What ``dpbench sweep`` refuses before anything starts (an unreachable Ray address, a user's
protocol publishing into the committed board, a frozen board), and whether rerunning can help a
failed trial."""

from __future__ import annotations

import socket
from pathlib import Path

from dpbench import records as records_lib
from dpbench.search.methods import REPO_ROOT as REPO



def retry_advice(error: str) -> str:
    """Whether rerunning can help a failed trial: a dpbench run that exits 2 refused its input
    (settings, a stage's declaration), which a rerun meets again; anything else (a crash, a
    kill, a lost worker) may pass on a rerun, which resumes the trial."""
    if "(exit 2)" in error:
        return ("its run refused its input (exit 2): a rerun fails the same way; fix the "
                "trial's settings or stage (its log says what), then rerun")
    return "rerun the same command to retry it (the trial resumes from its checkpoint)"


def unreachable_reason(address: str, timeout: float = 30.0):
    """None when a TCP connection to the Ray address's host:port opens within ``timeout``
    seconds, else a one-line reason: ray.init would otherwise retry for minutes with warnings
    only. ``auto`` (a cluster on this machine found by Ray itself) is not checked."""
    if address == "auto":
        return None
    host, _, port = address.split("://")[-1].rpartition(":")
    if not host or not port.isdigit():
        return f"--address={address!r} is not host:port (or ray://host:port, or auto)"
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        return (f"no Ray cluster answers at --address={address} ({e.strerror or e}); start one "
                "with `ray start --head` there, or leave --address out to run Ray locally")
    return None


def foreign_protocol_reason(protocol: Path, records: Path, official_board: bool):
    """None unless a protocol other than the board's own would publish into the committed
    board's records (leaderboard/records, the default --records): a user's own search must not
    mix its runs into the official board by leaving a flag out."""
    board = REPO / "leaderboard"
    if (official_board or Path(records).resolve() != (board / "records").resolve()
            or Path(protocol).resolve() == (board / "protocol.json").resolve()):
        return None
    return (f"--protocol={protocol} is not the board's own, but --records is the committed "
            f"board's ({board / 'records'}); pass --records=DIR for your own board (or "
            "--official_board to publish into the committed one)")


def frozen_board_reason(records: Path):
    """None unless ``records`` belong to a frozen board (an archive: its board.json holds the
    hashes of its records, which one more run would break)."""
    board = Path(records).resolve().parent
    if records_lib.frozen_spec(board) is None:
        return None
    return (f"{board} is frozen (an archive: its board.json holds the hashes of its records); "
            "nothing trains into it. Board v4's runs come from lent-GPU windows "
            "(tools/gpu_window.sh); your own board: --protocol=FILE --records=DIR")
