"""torchft replica groups: the one object the training loop asks at the start of a step and
before it commits.

Why torchft and why here: with HSDP a dead rank stops the whole job; with replica groups
each group is its own torchrun job, the groups agree on each step through torchft's
lighthouse, and a group that dies is left out of the next quorum while the others go on.
A restarted group heals from a live peer over torchft's checkpoint transport (HTTP), not
from disk.

The protocol, per step (all of it is torchft's `Manager`; this class only wires it to the
trainer):
  1. `start_step`: the quorum (synchronous: a healing group loads the peer's state
     here, before it reads a batch, so it joins at a step boundary);
  2. the token count and, after backward, the gradients and the loss terms are *summed*
     across the live groups through torchft's managed process group (the loss is already
     normalised by the global token count, so a sum is the HSDP replicate all-reduce);
  3. `should_commit`: the optimizer steps only if every rank of this group saw the
     collectives succeed and enough groups took part; otherwise the step is redone
     with the next quorum (same batches; the slice of a group that left is skipped).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from configuration.fields import ConfigError
from models.common.moe_balance import moe_load_counters
from parallelisms.sequence_shards import add_batch_shard_mesh
from trainer.fault_tolerance import heal_state
from trainer.fault_tolerance.config import FaultToleranceConfig, lighthouse_url
from trainer.fault_tolerance.hang import LEAD_S
from trainer.fault_tolerance.lighthouse import check_reachable

logger = logging.getLogger("trainer")

class StopRequested(Exception):
    """A stop signal (preemption) arrived while this group waited for a quorum: stop at this step
    boundary, as after a step, instead of waiting on."""


class _GroupsAsBatchMesh:
    """The live replica groups as one more data-parallel dimension of a batch- or model-scope balance loss:
    its size is the groups in this step's quorum (a step without a group routes fewer sequences
    together), and its sum is the cross-group all-reduce (in the forward; garbage on a failed
    peer, which should_commit then refuses)."""

    def __init__(self, groups: "ReplicaGroups"):
        self.groups = groups

    def size(self) -> int:
        return max(1, self.groups.participants)

    def all_reduce_sum(self, counts: torch.Tensor) -> torch.Tensor:
        return self.groups.all_reduce_sum(counts.clone())


BUCKET_BYTES = 64 << 20  # gradients cross groups in buckets of this size (bounded extra memory)


class _OneLineErrors(logging.Filter):
    """torchft logs each failed cross-group collective with logger.exception: a traceback on every
    rank of every healthy group whenever a peer group dies, which is what fault tolerance is for.
    Keep the first line of the error; drop the flight-recorder warning that CPU runs always get."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "flight recorder" in record.getMessage():
            return False
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            first = (str(error).strip().splitlines() or [""])[0][:200]
            record.msg, record.args = f"fault tolerance: {type(error).__name__}: {first}", None
            record.exc_info, record.exc_text = None, None
        return True


def quiet_torchft() -> None:
    """torchft logs every quorum and commit at INFO (Rust and Python): per step, on every rank.
    Keep warnings, with errors in one line; RUST_LOG / the loggers' levels set by the user win."""
    os.environ.setdefault("RUST_LOG", "warn")
    for name in ("torchft", "torchft_quorums", "torchft_commits"):
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    for name in ("torchft.manager", "torchft.process_group"):
        logger_ = logging.getLogger(name)
        if not any(isinstance(f, _OneLineErrors) for f in logger_.filters):
            logger_.addFilter(_OneLineErrors())


class ReplicaGroups:
    def __init__(self, cfg: FaultToleranceConfig, trainer, device: torch.device):
        quiet_torchft()
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.cfg = cfg
        self.group_rank = dist.get_rank() if dist.is_initialized() else 0
        if cfg.lighthouse is None:
            raise ConfigError("config error: fault_tolerance.lighthouse: not set; ./run_train.sh starts one for a "
                              "one-group run, otherwise start python -m trainer.fault_tolerance.lighthouse and give "
                              "its host:port")
        address = lighthouse_url(cfg.lighthouse)
        if self.group_rank == 0:  # the rank that talks to the lighthouse checks it first: one line, not a hang
            check_reachable(address, cfg.connect_timeout_seconds)
        heal_timeout = timedelta(seconds=cfg.heal_timeout_seconds)
        pg = ProcessGroupNCCL(timeout=heal_timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=heal_timeout)
        self.trainer, self.device = trainer, device
        self.healed_at: list[tuple[int, float]] = []  # (step, seconds) of each heal, for logs and the bench
        self.manager = Manager(
            pg=pg, min_replica_size=cfg.min_replicas, load_state_dict=self._load, state_dict=self._capture,
            use_async_quorum=False,  # heal before the step's first batch: the group joins at a step boundary
            timeout=heal_timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout_seconds),
            connect_timeout=timedelta(seconds=cfg.connect_timeout_seconds),
            rank=self.group_rank, world_size=dist.get_world_size() if dist.is_initialized() else 1,
            lighthouse_addr=address, replica_id=f"replica_{cfg.replica_id}", hostname=socket.gethostname(),
            init_sync=False)  # every group builds the same weights from training.seed
        self.manager.load_state_dict({"step": trainer.step, "batches_committed": 0})
        # A batch- or model-scope MoE balance loss (Qwen3's; "model" pools every layer's picks) counts
        # the picks of the whole global batch: the groups' batches too, as HSDP's data ranks do
        # (parallelisms/sequence_shards.py).
        for part in trainer.model_parts:
            add_batch_shard_mesh(part, _GroupsAsBatchMesh(self))
        self._healed, self._healed_bytes = False, 0
        self._first_quorum = True
        self._replica_rank: int | None = None  # this group's rank in the newest quorum it got

    # ---- 1. the quorum ----
    def start_step(self) -> bool:
        """Joins this step's quorum; True if this group healed from a peer (its step, data
        position and every tensor are now the peer's)."""
        from trainer import distributed as tdist

        self._healed = False
        t0 = time.perf_counter()
        # The hang watch and the group's own collectives allow for a slow quorum and a heal.
        with tdist.collective_timeout(self.cfg.quorum_timeout_seconds + self.cfg.heal_timeout_seconds + LEAD_S):
            self._quorum()
            if self._first_quorum:
                self._first_quorum = False
                self._wait_for_all_groups()
        if self._healed:
            seconds = time.perf_counter() - t0
            self.healed_at.append((self.trainer.step, seconds))
            logger.info(f"fault tolerance: healed from a live peer at step {self.trainer.step} in {seconds:.2f} s "
                        f"({self._healed_bytes / 2**20:.1f} MiB on this rank, quorum included)")
        return self._healed

    def _quorum(self) -> None:
        """torchft's quorum, waited for as long as the lighthouse answers.

        Why wait rather than fail: the lighthouse forms no quorum from half or fewer of the groups
        that are alive (its split-brain rule). A group that is alive but does not ask, because it
        writes a synchronous save longer than the quorum timeout or because one of its ranks hangs
        (its own hang watch ends it after comm.train_timeout_seconds, and then its heartbeat stops),
        makes every other group's quorum time out. torchft raises then, and a healthy group used
        to crash. Each try is agreed by the group's ranks: one whose try timed out while a peer's
        succeeded (they started a moment apart) must not leave that peer training alone.
        Raises StopRequested when a stop signal came while there was no quorum (the train loop
        stops at this step boundary), and ConfigError when the lighthouse stopped answering."""
        waited = 0.0
        while True:
            self.trainer.watch.at("fault tolerance: quorum")  # each try has the whole bound: waiting is no hang
            t0 = time.perf_counter()
            error: Exception | None = None
            try:
                self.manager.start_quorum()
            except Exception as e:  # noqa: BLE001 - torchft raises TimeoutError, or its RPC errors
                error = e
            lost = None
            if error is not None:
                try:
                    check_reachable(lighthouse_url(self.cfg.lighthouse), self.cfg.connect_timeout_seconds)
                except ConfigError as e:
                    lost = e
            failed, stop, gone = self._group_any([error is not None, self.trainer.preemption.requested(),
                                                  lost is not None])
            if not failed:
                self._replica_rank = self.manager.participating_rank()
                return
            # torchft 0.2.0 re-raises a failed quorum's error at the next start_quorum; start afresh.
            self.manager._quorum_future = None
            if stop:
                raise StopRequested()
            if gone:
                raise lost or ConfigError(f"config error: fault_tolerance.lighthouse: {self.cfg.lighthouse} stopped "
                                          "answering (seen by another rank of this group)")
            waited += time.perf_counter() - t0
            if self.group_rank == 0:
                logger.warning(f"fault tolerance: no quorum at step {self.trainer.step + 1} after {waited:.0f} s: "
                               "a replica group is alive but has not joined (a long checkpoint save, or a hung "
                               "rank that its own hang watch will end); waiting"
                               + (f" ({type(error).__name__}: {str(error).splitlines()[0][:120]})" if error else ""))

    def _group_any(self, flags: list[bool]) -> list[bool]:
        """Each flag, true if it is true on any rank of this group (one tiny all-reduce)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flags
        t = torch.tensor([float(f) for f in flags], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [v > 0 for v in t.tolist()]

    def _wait_for_all_groups(self) -> None:
        """A job's first step waits (up to the quorum timeout) for all group_count groups, so that
        groups started together also take step 1 together instead of the first one racing ahead
        and the others healing from it. Later steps wait only for the groups that are alive."""
        # A count, not a clock: every rank of the group must make the same number of quorum calls
        # (each one sees the same quorum, so they all leave the loop together).
        for _ in range(2 * self.cfg.quorum_timeout_seconds):
            if self.participants >= self.cfg.group_count or self._healed:
                break
            time.sleep(0.5)
            self._quorum()
        if self.participants < self.cfg.group_count and self.group_rank == 0:
            logger.warning(f"fault tolerance: starting with {self.participants} of {self.cfg.group_count} replica "
                           f"groups (the others did not join within {self.cfg.quorum_timeout_seconds} s)")

    def dump_for_test(self) -> None:
        """TITAN_TEST_FT_STATE: this rank's final state, for the bitwise comparison across groups."""
        from configuration.environment import env_value

        prefix = env_value("TITAN_TEST_FT_STATE")
        if prefix:
            path = f"{prefix}-replica{self.cfg.replica_id}-rank{self.group_rank}.pt"
            state = heal_state.capture(self.trainer)
            state["model_names"] = [[n for n, _ in heal_state.tensors_of(p)] for p in self.trainer.model_parts]
            torch.save(state, path)

    def _capture(self):
        return heal_state.capture(self.trainer)

    def _load(self, state) -> None:
        from torch.utils._pytree import tree_leaves

        self._healed_bytes = sum(t.numel() * t.element_size() for t in tree_leaves(state)
                                 if isinstance(t, torch.Tensor))
        heal_state.restore(self.trainer, state)
        self._healed = True

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    def is_saving_group(self) -> bool:
        """One group writes the checkpoints (the newest quorum's replica rank 0, whichever group that
        is): every group holds the same state, and all of them restarting read the same folder."""
        return self._replica_rank == 0

    # ---- 2. sums across the live groups ----
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place; on a failed peer the values are garbage, and should_commit says no."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return tensor

    @torch.no_grad()
    def reduce_gradients(self, params, loss_terms: torch.Tensor) -> None:
        """Sums every local gradient shard, this rank's loss terms and its MoE expert loads over the
        groups, in flat buckets: rank r of each group holds the same shards, so the sum is the HSDP
        replicate all-reduce. After FSDP's reduce-scatter, before clipping. The loads are summed
        before should_commit so that every group moves its expert bias by the global load, as HSDP
        does (the model's own hook then sums them over the group's mesh): summed per group, each
        group's bias followed its own data slice and routing drifted apart between groups."""
        grads = [g._local_tensor if hasattr(g, "_local_tensor") else g
                 for g in (p.grad for p in params) if g is not None]
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for t in [loss_terms, *moe_load_counters(self.trainer.model_parts), *grads]:
            if buckets[-1] and (buckets[-1][0].dtype != t.dtype or size + t.numel() * t.element_size() > BUCKET_BYTES):
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += t.numel() * t.element_size()
        for bucket in buckets:
            flat = torch.cat([t.reshape(-1) for t in bucket])  # [sum of numels]
            self.all_reduce_sum(flat)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    # ---- 3. commit ----
    def should_commit(self) -> bool:
        return self.manager.should_commit()

    def close(self) -> None:
        self.dump_for_test()
        self.manager.shutdown(wait=False)
