"""The global sample stream: mixing, shuffling, data-parallel sharding, workers, exact resume.

One stream of samples is defined for the whole job, independent of the number of
data-parallel ranks and DataLoader workers:

* global sample i comes from source ``s = mixture(i)`` (a Weyl sequence, see sampling.py)
  and is that source's ``j``-th sample, j = how many earlier samples chose s;
* a random-access source serves its j-th sample as window ``perm_e(j mod N)`` with
  ``e = j div N`` and ``perm_e`` a keyed bijection from (seed, source, e): a full global
  reshuffle every epoch, nothing materialised;
* a streaming source (raw text tokenized on the fly) serves its next window in order.

Each loader step takes the next ``dp x local_batch_size`` samples; dp rank r keeps rows
``[r*B, (r+1)*B)``. The position is therefore global: ``(next sample, samples taken per
source)``. A checkpoint stores it and a resumed run continues from it exactly, with any
dp degree (ranks new to a larger dp take dp rank 0's position, see trainer/checkpoint.py)
and any number of workers. Streaming sources are the exception: each (rank, worker) reads
its own files, so their state is per reader and exact only on the same layout.

Workers: with K workers, worker w makes loader steps k = w, w+K, ... (the DataLoader's
in-order round robin restores the sequence). Every worker walks the cheap assignment of
every step and fetches rows only for its own. Each batch carries the position after it,
so the main process always knows the state of what it has handed out, prefetching or not.
"""

from __future__ import annotations

import json
import logging
import warnings

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from trainer.data.sampling import Mixture, Permutation, derive_keys

logger = logging.getLogger(__name__)


def _to_batch(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(rows.astype(np.int64, copy=False))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class MixtureStream(IterableDataset):
    """Batches of this dp rank, as (inputs, labels, position after the batch)."""

    def __init__(self, sources: list, weights: list[float], *, seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_world_size: int, seed: int):
        super().__init__()
        if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_world_size={dp_world_size})")
        if seq_len < 1 or local_batch_size < 1:
            raise ValueError(f"seq_len={seq_len} and local_batch_size={local_batch_size} must be >= 1")
        self.sources, self.seq_len, self.seed = sources, seq_len, seed
        self.local_batch_size, self.dp_rank, self.dp_world_size = local_batch_size, dp_rank, dp_world_size
        self.mixture = Mixture(weights, seed)
        self.start = initial_position(len(sources))
        self.stream_states: dict[str, dict] = {}  # reader slot -> {source name: reader state}

    # ---- the global assignment ----
    def assign(self, sample: int, counts: list[int]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(source of each sample of the step, its index within that source, counts after the step)."""
        n = self.local_batch_size * self.dp_world_size
        src = self.mixture.sources(sample, n)
        within = np.empty(n, dtype=np.int64)
        after = list(counts)
        for s in range(len(self.sources)):
            mask = src == s
            taken = int(mask.sum())
            within[mask] = counts[s] + np.arange(taken)
            after[s] += taken
        return src, within, after

    def _window_rows(self, s: int, j: np.ndarray) -> np.ndarray:
        source = self.sources[s]
        if source.num_windows is None:  # infinite: no epochs, no shuffle needed
            return source.rows(j)
        epoch, pos = np.divmod(j, source.num_windows)
        windows = np.empty_like(j)
        for e in np.unique(epoch):
            m = epoch == e
            windows[m] = Permutation(source.num_windows, derive_keys(self.seed, s, int(e)))(pos[m])
        return source.rows(windows)

    def rows_for(self, src: np.ndarray, within: np.ndarray, readers: dict) -> np.ndarray:
        """This rank's [B, seq_len + 1] rows of a step."""
        lo = self.dp_rank * self.local_batch_size
        src, within = src[lo:lo + self.local_batch_size], within[lo:lo + self.local_batch_size]
        out = np.empty((len(src), self.seq_len + 1), dtype=np.int64)
        for s in np.unique(src):
            m = src == s
            source = self.sources[int(s)]
            if source.kind == "stream":
                out[m] = readers[source.name].take(int(m.sum()))
            else:
                out[m] = self._window_rows(int(s), within[m])
        return out

    # ---- iteration ----
    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        pos = dict(self.start)
        slot = str((pos["batches"] + wid) % nw)  # this worker's streaming readers, stable across resumes
        readers = {src.name: src.reader(self.dp_rank * nw + int(slot), self.dp_world_size * nw,
                                        self.stream_states.get(slot, {}).get(src.name))
                   for src in self.sources if src.kind == "stream"}
        k = 0
        while True:
            src, within, counts = self.assign(pos["sample"], pos["counts"])
            pos = {"sample": pos["sample"] + len(src), "counts": counts, "batches": pos["batches"] + 1}
            if k % nw == wid:
                x, y = _to_batch(self.rows_for(src, within, readers))
                yield x, y, {"position": pos, "streams": {slot: {n: r.state() for n, r in readers.items()}}}
            k += 1

    def meta(self) -> dict:
        """What a saved position means; a mismatch on load resumes approximately."""
        return {"seq_len": self.seq_len, "seed": self.seed,
                "sources": [[s.name, s.kind, -1 if s.num_windows is None else int(s.num_windows)]
                            for s in self.sources], "weights": [round(w, 12) for w in self.mixture.weights]}

    def stream_layout(self, num_workers: int) -> list[int]:
        return [self.dp_rank, self.dp_world_size, num_workers]

    def describe(self) -> str:
        parts = [f"{w:.3g} x {s.describe()}" if len(self.sources) > 1 else s.describe()
                 for s, w in zip(self.sources, self.mixture.weights)]
        return "; ".join(parts)


def initial_position(num_sources: int) -> dict:
    return {"sample": 0, "counts": [0] * num_sources, "batches": 0}


def _keep(batch):
    return batch


class DataLoader:
    """Iterates a MixtureStream (in worker processes if num_workers > 0) and keeps its position.

    ``iter(loader)`` yields (inputs, labels) int64 [local_batch_size, seq_len]; it resumes
    from the current position, so a fresh iteration continues where the last one stopped.
    """

    def __init__(self, stream: MixtureStream, num_workers: int = 0, prefetch_factor: int = 2):
        self.dataset = stream
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self._position = initial_position(len(stream.sources))
        self._streams: dict[str, dict] = {}

    def __iter__(self):
        self.dataset.start, self.dataset.stream_states = dict(self._position), dict(self._streams)
        if self.num_workers == 0:
            batches = iter(self.dataset)
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*set_vital.*")
                batches = iter(torch.utils.data.DataLoader(self.dataset, batch_size=None, collate_fn=_keep,
                                                           num_workers=self.num_workers,
                                                           prefetch_factor=self.prefetch_factor))
        for x, y, state in batches:
            self._position = state["position"]
            self._streams.update(state["streams"])
            yield x, y

    @property
    def position(self) -> dict:
        return dict(self._position)

    def state_dict(self) -> dict:
        """One JSON string: torch.distributed.checkpoint loads into a template of the same keys,
        and a single leaf keeps that template valid whatever sources, readers or carry it holds."""
        return {"loader_state": json.dumps({
            "position": self._position, "streams": self._streams, "meta": self.dataset.meta(),
            "stream_layout": self.dataset.stream_layout(self.num_workers)}, sort_keys=True)}

    def load_state_dict(self, state: dict) -> None:
        state = json.loads(state["loader_state"]) if "loader_state" in state else state
        position, meta = dict(state["position"]), self.dataset.meta()
        if state.get("meta") != meta:
            logger.warning("data: the saved position was taken with %s but this run has %s; resuming approximately "
                           "at global sample %d", state.get("meta"), meta, position["sample"])
            if len(position["counts"]) != len(self.dataset.sources):
                position["counts"] = [0] * len(self.dataset.sources)
        streams = dict(state.get("streams") or {})
        has_streams = any(s.kind == "stream" for s in self.dataset.sources)
        if has_streams and list(state.get("stream_layout", [])) != self.dataset.stream_layout(self.num_workers):
            logger.warning("data: streaming sources were read by dp rank/degree/workers %s, now %s; each reader "
                           "restarts at the earliest saved point (some text is seen twice)",
                           state.get("stream_layout"), self.dataset.stream_layout(self.num_workers))
            earliest = _earliest_stream_states(streams)
            streams = {str(c): earliest for c in range(max(1, self.num_workers))}
        self._position = {"sample": int(position["sample"]), "counts": [int(c) for c in position["counts"]],
                          "batches": int(position.get("batches", 0))}
        self._streams = streams

    def metrics(self) -> dict[str, float]:
        """Tokens (labels) drawn so far from each source, summed over all dp ranks."""
        return {f"data/tokens/{s.name}": float(c * self.dataset.seq_len)
                for s, c in zip(self.dataset.sources, self._position["counts"])}

    def describe(self) -> str:
        return self.dataset.describe()


def _earliest_stream_states(streams: dict) -> dict:
    """Per source, the earliest (epoch, fraction of the epoch) any reader had reached."""
    out: dict = {}
    for per_source in streams.values():
        for name, st in (per_source or {}).items():
            key = (st["epoch"], st["fraction"])
            if name not in out or key < (out[name]["epoch"], out[name]["fraction"]):
                out[name] = {"epoch": st["epoch"], "fraction": st["fraction"]}
    return out
