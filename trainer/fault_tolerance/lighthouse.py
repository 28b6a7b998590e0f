"""torchft's lighthouse: the one process every replica group asks for the quorum of each step.

    python -m trainer.fault_tolerance.lighthouse --port 29510 --min-replicas 1

It is torchft's own server (`torchft._torchft.LighthouseServer`, built into the wheel);
this wrapper only starts it with our defaults, prints its address, and exits when told
(SIGTERM/SIGINT) or when the process that started it is gone (run_train.sh's lighthouse
must not outlive the run). `check_reachable` is the start-up check that turns an address
nobody answers at into one line instead of a hang in torchft's client.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from urllib.parse import urlsplit

from configuration.fields import ConfigError
from trainer.fault_tolerance.config import lighthouse_url

# A group that stops heartbeating is out of the quorum after this long (torchft's default 5 s).
HEARTBEAT_TIMEOUT_MS = 5000
# How long a quorum waits for a group that is alive but has not asked yet (e.g. one starting up).
JOIN_TIMEOUT_MS = 1000


def check_reachable(address: str, timeout_s: float) -> None:
    """Raises ConfigError naming `address` if no TCP connection can be made within timeout_s."""
    parts = urlsplit(lighthouse_url(address))
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            with socket.create_connection((parts.hostname, parts.port), timeout=max(0.1, deadline - time.monotonic())):
                return
        except OSError as e:
            last = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise ConfigError(f"config error: fault_tolerance.lighthouse: nothing answers at {address} ({last}) "
                              f"within {timeout_s:g} s; start the lighthouse (python -m "
                              "trainer.fault_tolerance.lighthouse) or fix the address")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=29510)
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--join-timeout-ms", type=int, default=JOIN_TIMEOUT_MS)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=HEARTBEAT_TIMEOUT_MS)
    ap.add_argument("--address-file", help="write the address here once it serves")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    ap.add_argument("--ignore-stop-signals", action="store_true",
                    help="ignore SIGTERM and SIGUSR1 (scripts/ft_trainer.slurm: a stop asked of the job is for its "
                         "groups, which still need the lighthouse while they finish; the script ends it)")
    args = ap.parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum request at INFO
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{args.port}", min_replicas=args.min_replicas,
                              join_timeout_ms=args.join_timeout_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    address = server.address()
    print(f"lighthouse: serving at {address} (min_replicas {args.min_replicas})", flush=True)
    if args.address_file:
        tmp = f"{args.address_file}.tmp"
        with open(tmp, "w") as f:
            f.write(address + "\n")
        os.replace(tmp, args.address_file)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    if args.ignore_stop_signals:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
    while not stop:
        if args.parent_pid and not _alive(args.parent_pid):
            break
        time.sleep(0.5)
    server.shutdown()
    return 0


def _alive(pid: int) -> bool:
    """False once `pid` has exited, zombie included: a launcher that has exited but is not yet
    reaped (its parent is still reading the pipes this process holds open) counts as gone, or
    the two would wait on each other for ever."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): signal 0 says only whether the pid exists
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

if __name__ == "__main__":
    sys.exit(main())
