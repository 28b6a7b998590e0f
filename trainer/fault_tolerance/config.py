"""[fault_tolerance]: torchft replica groups, checked in one place (`validate`).

Why a section of its own: with it on, the data-parallel replicate dimension is no longer a
mesh dimension of one job but a set of independent torchrun jobs (replica groups) that agree
on each step through torchft's lighthouse. The group layout inside each job is the usual
[parallelism] section, so FT and `data_parallel_replicate_degree > 1` are exclusive.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from configuration.fields import ConfigError, opt

TORCHFT_PIP = "pip install 'torchft==0.2.0' (or pip install -e '.[ft]')"


def lighthouse_url(address: str) -> str:
    """torchft's form of an address: http://host:port (a bare host:port gets the scheme)."""
    return address if "://" in address else f"http://{address}"


def _parse_address(value):
    if value is None:
        return None
    text = str(value).strip()
    host_port = text.split("://", 1)[-1].rstrip("/")
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port or http://host:port, got {value!r}")
    return text


@dataclass
class FaultToleranceConfig:
    """[fault_tolerance]"""

    enable: bool = opt(False, "torchft replica groups: each group is one torchrun job (FSDP/TP/PP/CP/EP inside); "
                       "gradients are summed across the groups that are alive, a step commits only when the "
                       "quorum agrees, and a restarted group heals from a live peer (docs/fault_tolerance.md). "
                       "Needs the ft extra: " + TORCHFT_PIP + ".")
    replica_id: int = opt(0, "This group's index, 0 .. group_count-1: it picks the group's slice of every "
                          "global batch (scripts/ft_trainer.slurm sets it per job step).", min=0)
    group_count: int = opt(1, "Replica groups at full strength. Every global batch has group_count slices; the "
                           "slice of a group that is away is skipped, never read twice.", min=1)
    min_replicas: int = opt(1, "Groups that must be alive for a step to commit (the lighthouse's quorum size "
                            "when run_train.sh starts it).", min=1)
    lighthouse: str | None = opt(None, "Address of torchft's lighthouse (host:port or http://host:port). None: "
                                 "./run_train.sh starts one on this machine for a one-group run.",
                                 parse=_parse_address)
    quorum_timeout_seconds: int = opt(60, "How long a step waits for the quorum (all live groups joining). A dead "
                                      "group costs the survivors at most about this once.", min=1)
    heal_timeout_seconds: int = opt(60, "Timeout of the cross-group collectives, the should-commit vote and the "
                                    "state transfer that heals a restarted group. Must stay below "
                                    "comm.train_timeout_seconds less the hang watch's lead (checked at start), or a "
                                    "rank waiting for another group would be taken for hung by its own.", min=1)
    connect_timeout_seconds: int = opt(10, "How long the start waits for the lighthouse to answer before the "
                                       "run stops with one line naming its address.", min=1)

    def validate(self, root) -> None:
        """Every check of the section (run_train.sh's --check-config and each worker run it)."""
        if not self.enable:
            return
        if importlib.util.find_spec("torchft") is None:
            raise ConfigError(f"config error: fault_tolerance.enable: torchft is not installed; {TORCHFT_PIP}")
        if root.parallelism.data_parallel_replicate_degree > 1:
            raise ConfigError("config error: parallelism.data_parallel_replicate_degree: "
                              f"{root.parallelism.data_parallel_replicate_degree} with fault_tolerance.enable; the "
                              "replicas are the torchft groups (fault_tolerance.group_count), set it to 1")
        if self.group_count < self.min_replicas:
            raise ConfigError(f"config error: fault_tolerance.min_replicas: {self.min_replicas} exceeds "
                              f"fault_tolerance.group_count {self.group_count}; no step could ever commit, lower "
                              "min_replicas or raise group_count")
        from trainer.fault_tolerance.hang import watch_bound

        bound = watch_bound(root.comm.train_timeout_seconds)
        if self.heal_timeout_seconds >= bound:
            raise ConfigError(f"config error: fault_tolerance.heal_timeout_seconds: {self.heal_timeout_seconds} is not "
                              f"below the hang watch's bound of {bound:g} s (comm.train_timeout_seconds "
                              f"{root.comm.train_timeout_seconds}, less its lead); a rank that waits that long for "
                              "another group would be taken for hung by its own group, which would crash; raise "
                              "comm.train_timeout_seconds or lower heal_timeout_seconds")
        if self.replica_id >= self.group_count:
            raise ConfigError(f"config error: fault_tolerance.replica_id: {self.replica_id} is not below "
                              f"fault_tolerance.group_count {self.group_count}; groups are numbered from 0")


def data_slice(cfg: FaultToleranceConfig, group_dp_rank: int, group_dp_degree: int) -> tuple[int, int]:
    """(data rank, data degree) over the whole job: group g's dp rank r reads slice
    g * group_dp + r of the group_count * group_dp slices of each global batch."""
    if not cfg.enable:
        return group_dp_rank, group_dp_degree
    return cfg.replica_id * group_dp_degree + group_dp_rank, cfg.group_count * group_dp_degree


def log_folder(root) -> str:
    """Where this process writes metrics.jsonl, TensorBoard events and hang stacks: the dump
    folder, or <dump>/replica-<id> under fault tolerance (groups would overwrite each other's).
    Checkpoints stay in the shared <dump>/checkpoint, written by one group (replicas.py)."""
    ft = root.fault_tolerance
    return f"{root.job.dump_folder}/replica-{ft.replica_id}" if ft.enable else root.job.dump_folder


def checkpoint_writer(root) -> str | None:
    """The name this job's temporary checkpoint folders carry (trainer/checkpoint_files.py): the
    replica groups share <dump>/checkpoint and each may be the one that saves, so each repairs
    only its own leftovers at start. None without fault tolerance: the job is the one writer."""
    ft = root.fault_tolerance
    return f"replica-{ft.replica_id}" if ft.enable else None
