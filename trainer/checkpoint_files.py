"""A checkpoint folder on disk: when a save counts as done, how it replaces an older one,
and how a load knows the bytes are the ones that were written.

    <folder>/step-N/.metadata, __R_I.distcp   DCP's files (rank R wrote __R_*)
    <folder>/step-N/manifest.json             size + CRC32 per 64 MiB block of every file

Life of a save, and what a crash at each point leaves (the next start repairs it in
`recover`, on rank 0, before anything is loaded):

    1. every rank writes into step-N.tmp          crash: .tmp without manifest -> deleted
    2. every rank checksums its own files
    3. rank 0 writes step-N.tmp/manifest.json     the commit point: from here on the save counts
    4. step-N -> step-N.old (if it exists)        crash: .tmp with manifest -> renamed in
    5. step-N.tmp -> step-N                       crash: step-N.old beside step-N -> deleted
    6. delete step-N.old

So a `step-N` folder is never a mix of two saves, and no crash loses a save that passed
its commit point.

Who may repair: only the writer, its own leftovers. Under fault tolerance several replica
groups share the folder and any one of them may be the writer, so its temporary folders
carry its name (`temp_folder`: step-N.replica-1.tmp, step-N.replica-1.old) and a group
that starts repairs only its own: a group restarting beside a live one used to delete the
live group's save in progress (a `.tmp` without a manifest yet). Without fault tolerance
there is one writer, the job, and its start repairs every leftover. Before this protocol, replacing step-N was rmtree + rename, and a
SIGKILL in between left a step-N with only `.metadata`, which the loader took as complete.

Why CRC32 in blocks: zlib.crc32 runs at ~1.2 GB/s on one core of a slow CPU (faster with
zlib-ng), releases the GIL, so blocks are summed by a thread pool, and it catches every
single flipped bit, which is the failure it is for (bit rot, a bad copy, a truncated
upload); it is not a defence against tampering. `scripts/bench_checkpoint.py` prints the
cost per GB.

Crash points for tests: TITAN_CHECKPOINT_CRASH_AT=<point>[@<step>] SIGKILLs the process at
`async_write` (inside the background write, data written but not its metadata),
`after_write` (every rank done, nothing committed), `before_rename` (manifest written) or
`after_aside` (old step-N renamed aside, new one not yet in), or at the end of a step,
after the step-boundary commit (`step_end`).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import signal
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from configuration.fields import ConfigError

STEP_DIR = re.compile(r"^step-(\d+)$")
TMP, OLD = ".tmp", ".old"
# step-N[.<writer>].tmp / .old: a save in progress, or the copy it replaces, of one writer.
LEFTOVER = re.compile(r"^(step-\d+)(?:\.([A-Za-z0-9_-]+))?(\.tmp|\.old)$")
MANIFEST = "manifest.json"
BLOCK_BYTES = 64 * 2**20
CRASH_ENV = "TITAN_CHECKPOINT_CRASH_AT"
HOLD_ENV = "TITAN_CHECKPOINT_HOLD_AT"


def crash_point(name: str, step: int) -> None:
    """Test hooks: SIGKILL this process at `name` when TITAN_CHECKPOINT_CRASH_AT asks for it; hold it
    there while a file exists when TITAN_CHECKPOINT_HOLD_AT=<point>@<step>=<file> does (the process
    creates the file; the test deletes it to let the save go on)."""
    from configuration.environment import env_value

    want = env_value(CRASH_ENV)
    point, _, at = want.partition("@")
    if want and point == name and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)
    hold, _, path = env_value(HOLD_ENV).partition("=")
    if hold == f"{name}@{step}":
        Path(path).touch()
        deadline = time.monotonic() + 600
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.1)


class CheckpointError(RuntimeError):
    """An unreadable or mismatching checkpoint; one line naming the path and the fix.
    `damaged` (path, why) when its files are (missing, truncated, checksum, unreadable
    metadata), which checkpoint.on_corrupt = "fallback" may set aside; None for a mismatch
    (another model), which no older checkpoint fixes."""

    def __init__(self, message: str, damaged: tuple[Path, str] | None = None):
        super().__init__(message)
        self.damaged = damaged


# ---- checksums ----
def _block_crcs(path: Path) -> tuple[int, list[int]]:
    """(size, CRC32 of each 64 MiB block). The file is mapped, not read: no copies, about 3x
    faster than read(); blocks are summed by a thread pool (crc32 releases the GIL)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0, [zlib.crc32(b"")]
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
                    crcs = list(pool.map(lambda start: zlib.crc32(view[start:start + BLOCK_BYTES]),
                                         range(0, size, BLOCK_BYTES)))
            finally:
                view.release()
    return size, crcs


def checksum_files(paths: list[Path]) -> dict[str, dict]:
    """{file name: {"size": bytes, "crc32": [one per 64 MiB block]}}."""
    out = {}
    for p in paths:
        size, crcs = _block_crcs(p)
        out[p.name] = {"size": size, "crc32": crcs}
    return out


def rank_files(folder: Path, rank: int) -> list[Path]:
    """The files one rank wrote in a DCP save (rank 0 also wrote .metadata)."""
    files = sorted(folder.glob(f"__{rank}_*.distcp"))
    if rank == 0 and (folder / ".metadata").is_file():
        files.append(folder / ".metadata")
    return files


def write_manifest(folder: Path, files: dict[str, dict], *, step: int, kind: str) -> None:
    tmp = folder / (MANIFEST + TMP)
    with open(tmp, "w") as f:
        json.dump({"format": 1, "step": step, "kind": kind, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify_files(folder: Path, manifest: dict, names: list[str]) -> str | None:
    """The first problem with `names` (a share of the manifest's files), or None."""
    for name in names:
        want = manifest["files"][name]
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} were written (truncated or replaced)"
        _, crcs = _block_crcs(path)
        if crcs != want["crc32"]:
            block = next(i for i, (a, b) in enumerate(zip(crcs, want["crc32"])) if a != b)
            return f"{name} differs from what was written (checksum mismatch at byte {block * BLOCK_BYTES}+)"
    return None


# ---- the folder ----
def step_folders(folder: Path) -> list[tuple[int, Path]]:
    """Every `step-N` folder, complete or not, oldest first."""
    if not folder.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(out)


def incomplete_reason(path: Path) -> str | None:
    """Why `path` is not a committed save, from file names and sizes only (no reads), or None.
    Committed: a manifest whose files are all there at their sizes (for folders from before
    manifests: DCP's .metadata)."""
    manifest = read_manifest(path)
    if manifest is None:
        if (path / MANIFEST).exists():
            return f"its {MANIFEST} is unreadable"
        return None if (path / ".metadata").is_file() else "it has no .metadata or manifest (an unfinished save)"
    for name, entry in manifest["files"].items():
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != entry["size"]:
            return f"{name} has {size} bytes, {entry['size']} were written (truncated or replaced)"
    return None


def is_complete(path: Path) -> bool:
    return incomplete_reason(path) is None


def kind_of(path: Path) -> str:
    """"full" (training state) or "model" (weights only: a seed checkpoint or an export)."""
    manifest = read_manifest(path)
    if manifest is not None:
        return manifest.get("kind", "full")
    import torch.distributed.checkpoint as dcp

    try:
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable metadata is reported when it is loaded
        return "full"
    return "full" if any(k.startswith("optimizer") for k in keys) else "model"


def temp_folder(final: Path, writer: str | None, suffix: str = TMP) -> Path:
    """step-N.tmp (or .old), or step-N.<writer>.tmp when several writers share the folder."""
    return final.with_name(f"{final.name}.{writer}{suffix}" if writer else final.name + suffix)


def replace(tmp: Path, final: Path, step: int, writer: str | None = None) -> None:
    """Steps 4-6: the committed `tmp` becomes `final`; an older `final` is never half-deleted."""
    old = temp_folder(final, writer, OLD)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        crash_point("after_aside", step)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def recover(folder: Path, writer: str | None = None) -> list[str]:
    """Finishes or discards what a crash left (rank 0, at start); returns one log line per fix.
    `writer` None: every leftover (one writer: the job). A name: only that writer's own, which
    no one else is writing (another writer's save may be in progress right now)."""
    notes: list[str] = []
    if not folder.is_dir():
        return notes
    mine = []
    for p in sorted(folder.iterdir()):
        m = LEFTOVER.match(p.name)
        if m and p.is_dir() and (writer is None or m.group(2) == writer):
            mine.append((p, folder / m.group(1), m.group(2), m.group(3)))
    for p, final, tag, kind in mine:
        if kind == TMP:
            if (p / MANIFEST).is_file() and is_complete(p):
                replace(p, final, -1, tag)
                notes.append(f"{final.name}: finished a commit that a crash interrupted")
            else:
                shutil.rmtree(p, ignore_errors=True)
                notes.append(f"{p.name}: removed an unfinished save")
    for p, final, tag, kind in mine:
        if kind == OLD and p.is_dir():
            if final.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.replace(p, final)
                notes.append(f"{final.name}: restored the copy set aside by an interrupted replace")
    return notes


# ---- which checkpoint a run resumes from ----
def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Complete (committed) checkpoints, oldest first."""
    return [(s, p) for s, p in step_folders(folder) if is_complete(p)]


def refusal(folder: Path, path: Path, why: str, damaged: bool = False) -> CheckpointError:
    steps = [s for s, _ in list_checkpoints(folder)]
    fix = ("delete it, or set checkpoint.on_corrupt = \"fallback\", to resume from the one before, or pass "
           if damaged else "delete it to resume from the one before, or pass ")
    return CheckpointError(f"checkpoint error: {path} {why}; {fix}--checkpoint.load_step N (complete: {steps})",
                           damaged=(path, why) if damaged else None)


CORRUPT = ".corrupt"


def falls_back(folder: Path, error: CheckpointError, on_corrupt: str, load_step: int) -> bool:
    """checkpoint.on_corrupt = "fallback" applies to `error`: damage to a step-N folder of this
    run, no explicit load_step, and an older complete checkpoint to resume from instead."""
    if on_corrupt != "fallback" or load_step >= 0 or error.damaged is None:
        return False
    path = error.damaged[0]
    m = STEP_DIR.match(path.name)
    return (m is not None and path.parent.resolve() == folder.resolve()
            and any(s < int(m.group(1)) for s, _ in list_checkpoints(folder)))


def set_aside(path: Path) -> Path:
    """Renames a damaged step-N to step-N.corrupt (.corrupt-2, ... if taken), which no listing
    matches; kept, not deleted, so a person can look at it."""
    target, k = path.with_name(path.name + CORRUPT), 1
    while target.exists():
        k += 1
        target = path.with_name(f"{path.name}{CORRUPT}-{k}")
    os.replace(path, target)
    return target


def choose_resume(folder: Path, load_step: int = -1) -> Path | None:
    """The checkpoint a run resumes from: load_step's, else the newest full training state
    (else the newest model-only one, e.g. a seed). A newer step-N folder that is not complete
    (from names and sizes; no file is read) is refused by name, not skipped."""
    every = step_folders(folder)
    steps = [s for s, p in every if is_complete(p)]
    if load_step >= 0:
        match = [p for s, p in every if s == load_step]
        if not match:
            raise ConfigError(f"config error: checkpoint.load_step: no checkpoint step-{load_step} in "
                              f"{folder}; complete ones: {steps}")
        if not is_complete(match[0]):
            raise ConfigError(f"config error: checkpoint.load_step: {match[0]} is not a complete checkpoint "
                              f"({incomplete_reason(match[0])}); complete ones: {steps}")
        return match[0]
    complete = [(s, p) for s, p in every if is_complete(p)]
    full = [(s, p) for s, p in complete if kind_of(p) == "full"]
    newest_step, newest = (full or complete or [(-1, None)])[-1]
    broken = [p for s, p in every if s > newest_step and not is_complete(p)]
    if broken:
        raise refusal(folder, broken[-1], f"is not a complete checkpoint: {incomplete_reason(broken[-1])}",
                      damaged=True)
    return newest
