"""The training loop: build -> loop -> close. Run with `python -m trainer.train` (under torchrun).

How a step flows: pull every microbatch of the step, count the valid tokens over
the whole global batch, run forward/backward per microbatch (or the pipeline
schedule) with each loss divided by that global count, clip the gradient norm
across every mesh dimension, step the optimizer and LR schedule, run the model's
post-step hook (MoE bias update), then log, checkpoint and profile.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from models.common.moe_balance import set_aux_loss_sequences
from parallelisms.apply import autocast_context, build_model_parts, resolve_precision
from parallelisms.grad_clip import clip_grad_norm_
from parallelisms.grad_reduce import settle_gradient_placements
from parallelisms.parallel_dims import ParallelDims
from trainer import distributed as tdist
from trainer.checkpoint import CheckpointError, Checkpointer
from trainer.config import DEFAULT_TOKENIZER, JobConfig, main_guard, print_model_summary
from configuration.fields import ConfigError
from configuration.environment import global_rank
from trainer.errors import report_user_error, run_entry_point
from trainer.fault_tolerance.config import checkpoint_writer, data_slice, log_folder
from trainer.fault_tolerance.hang import HangWatch, inject_test_faults
from trainer.fault_tolerance.replicas import StopRequested
from models.hf_config import read_hf_config
from trainer.hf_io import load_hf_weights
from trainer.loss import TokenNormalizedLoss, chunked_ce_labels, count_tokens, install_chunked_ce_head
from trainer.metrics import MetricsLogger, StragglerMonitor, attention_flops_per_token
from trainer.layout import batch_layout
from trainer.model_args import check_tokenizer_fits, model_label, tokenizer_path
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.preemption import PREEMPTED_EXIT, PreemptionHandler
from trainer.profiling import MemorySnapshotter, maybe_profile
from trainer.step_guard import StepGuard
from trainer.validation import build_validator, training_holdout

logger = logging.getLogger("trainer")


def setup_logging() -> None:
    rank = global_rank()
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)


@dataclass
class StepResult:
    """What one optimizer step reports: the global mean token loss, the pre-clip gradient
    norm, the learning rate the step used, and model metrics (MoE load) when asked for."""

    loss: float
    grad_norm: float
    lr: float
    extra_metrics: dict[str, float] = field(default_factory=dict)
    skipped: str | None = None  # why the step was not applied (trainer/step_guard.py)
    stop: bool = False  # some rank was asked to stop (preemption), agreed by every rank
    save_busy: bool = False  # some rank was still writing the pending async save (then it is not committed)
    committed: bool = True  # False: torchft's quorum changed during the step; it is redone (fault tolerance)


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        t = cfg.training
        # First, so that a preemption signal during start-up is remembered, not fatal.
        self.preemption = PreemptionHandler()
        self.device = tdist.pick_device(t.device)
        self.backend = tdist.init_distributed(self.device, cfg.comm.init_timeout_seconds,
                                              cpu_collectives=cfg.parallelism.fsdp_cpu_offload)
        self.rank = global_rank()
        if cfg.model_args is None:  # a JobConfig built in code, not by load_config
            cfg.validate()
        self.spec, self.model_args = cfg.model_spec, cfg.model_args
        self.dims = ParallelDims.from_config(cfg.parallelism, tdist.world_size())
        self.dims.build_mesh(self.device.type)
        tdist.set_seed(t.seed, t.deterministic)
        self.precision = resolve_precision(t, self.device.type, fsdp_enabled=self.dims.fsdp_mesh() is not None)

        # ---- batch layout ----
        # With fault tolerance each replica group reads its own slice of the job's global batch.
        self.dp_rank, self.dp_degree = data_slice(cfg.fault_tolerance, self.dims.coordinate("dp"), self.dims.dp_degree)
        self.grad_accum_steps, self.global_batch_size = batch_layout(t, self.dp_degree)

        # ---- data ----
        from trainer.data import build_dataloader
        from trainer.data.masking import ModelInputs
        from trainer.data.tokenizer import build_tokenizer

        self.tokenizer_path = tokenizer_path(cfg, DEFAULT_TOKENIZER)
        self.tokenizer = build_tokenizer(self.tokenizer_path)
        check_tokenizer_fits(self.tokenizer, self.model_args, model_label(cfg))
        self.model_inputs = ModelInputs(cfg.data.document_masking, self.tokenizer)
        self.dataloader = build_dataloader(
            cfg.data, tokenizer=self.tokenizer, tokenizer_path=self.tokenizer_path, seq_len=t.seq_len,
            local_batch_size=t.local_batch_size, dp_rank=self.dp_rank, dp_world_size=self.dp_degree, seed=t.seed,
            holdout=training_holdout(cfg.validation))
        self.validator = build_validator(cfg, self.tokenizer, self.tokenizer_path, self.dims.coordinate("dp"),
                                         self.dims.dp_degree,
                                         self.dims.mesh("dp_cp"))

        # ---- model: the one assembly path (parallelisms/apply.py) ----
        self.mtp_depth = getattr(self.model_args, "mtp_depth", 0)
        self.loss_fn = TokenNormalizedLoss(chunked_ce=cfg.loss.chunked_ce, mtp_depth=self.mtp_depth,
                                           mtp_weight=cfg.loss.mtp_weight)
        built = build_model_parts(self.spec, self.model_args, self.dims, cfg, self.device, loss_fn=self.loss_fn,
                                  prepare=lambda model: install_chunked_ce_head(model, cfg.loss))
        self.model_parts, self.pp_schedule = built.parts, built.schedule
        self.has_first_stage, self.has_last_stage = built.has_first_stage, built.has_last_stage
        self.num_params, self.flops_per_token = built.summary["params"], built.summary["flops_per_token"]
        tdist.set_seed(t.seed, t.deterministic)
        # MoE balance loss: one mean over the sequences of the global batch (a no-op without MoE).
        set_aux_loss_sequences(self.model_parts, self.global_batch_size)

        # ---- optimizer, schedule, checkpoint, metrics ----
        self.optimizers = [build_optimizer(p, cfg.optimizer, self.device.type, whole_model=built.whole_model_params)
                           for p in self.model_parts]
        self.lr_schedulers = [build_lr_scheduler(o, t.steps, cfg.lr_scheduler) for o in self.optimizers]
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.job.dump_folder, model_parts=self.model_parts,
                                         optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
                                         dataloader=self.dataloader, dp_rank=self.dp_rank,
                                         writer=checkpoint_writer(cfg))
        if cfg.checkpoint.create_seed_checkpoint:
            if tdist.world_size() != 1:
                raise ConfigError("config error: checkpoint.create_seed_checkpoint: run it with one process "
                                  "(NGPU=1), so that the weights do not depend on a parallel layout")
        self.step = 0 if cfg.checkpoint.create_seed_checkpoint else self.checkpointer.load()
        # after load: it repairs crashed saves and may set damaged ones aside (checkpoint.on_corrupt)
        resuming = cfg.checkpoint.enable and self.checkpointer.resume_path() is not None
        if cfg.model.hf_path and not resuming and not cfg.checkpoint.initial_load_path:
            # model.hf_path: the folder's weights, unless a checkpoint resumes (or initial_load_path gives others).
            load_hf_weights(self.model_parts, cfg.model.hf_path)
        if cfg.model.hf_path and self.rank == 0:  # what an imported config trains with beyond the weights
            note = getattr(self.spec.state_dict_adapter, "balance_note", None)
            line = note(self.model_args, read_hf_config(cfg.model.hf_path)) if note else None
            if line:
                logger.info(f"{model_label(cfg)}: {line}")
        # Global rank 0 logs (what run_train.sh shows by default): train_step all-reduces the
        # loss over dp and, with PP, from the last stage along the pipeline, and the grad norm
        # is global, so every rank holds the values it logs.
        self.is_logging_rank = self.rank == 0
        self.log_folder = log_folder(cfg)  # per replica group under fault tolerance
        self.metrics = MetricsLogger(cfg.metrics, self.log_folder, enabled=self.is_logging_rank,
                                     device=self.device, flops_per_token=self.flops_per_token,
                                     non_data_parallel_size=self.dims.non_data_parallel_size, start_step=self.step,
                                     attention_flops_per_token=attention_flops_per_token(self.model_args, t.seq_len))
        # Hangs named in one line, stacks on disk (fault_tolerance/hang.py); per-rank step times (metrics.py).
        self.watch = HangWatch(self.log_folder, self.rank, tdist.world_size(),
                               lambda: tdist.current_collective_timeout() or cfg.comm.train_timeout_seconds)
        self.stragglers = StragglerMonitor(cfg.metrics, self.rank, tdist.world_size(), log=self.is_logging_rank)
        self.guard = StepGuard(t.max_skipped_steps, t.loss_spike_factor, lr=cfg.optimizer.lr)
        self.data_iter = iter(self.dataloader)
        # torchft replica groups (trainer/fault_tolerance/replicas.py): quorum, cross-group sums, commit, heal.
        self.ft = None
        if cfg.fault_tolerance.enable:
            from trainer.fault_tolerance.replicas import ReplicaGroups

            self.ft = ReplicaGroups(cfg.fault_tolerance, self, self.device)
        gc.disable()
        if self.rank == 0:
            logger.info(f"model {model_label(cfg)}: {self.num_params:,} params, "
                        f"{self.flops_per_token:,.0f} FLOPs/token; world {tdist.world_size()} "
                        f"(dp_replicate {self.dims.dp_replicate}, dp_shard {self.dims.dp_shard}, cp {self.dims.cp}, "
                        f"tp {self.dims.tp}, "
                        f"pp {self.dims.pp}, ep {self.dims.ep}); {self.device.type}/{self.backend or 'single'}, "
                        f"param dtype {self.precision.param}; global batch {self.global_batch_size} = local "
                        f"{t.local_batch_size} x dp {self.dp_degree} x accum {self.grad_accum_steps}; "
                        f"starting at step {self.step}")

    # ---- one optimizer step ----
    def next_microbatches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches = [tuple(x.to(self.device, non_blocking=True) for x in next(self.data_iter))
                   for _ in range(self.grad_accum_steps)]
        if self.dims.cp > 1:  # CP ranks share the batch; each keeps its two chunks of every sequence
            from parallelisms.context_parallel import shard_microbatch

            batches = [shard_microbatch(inputs, labels, self.dims.mesh("cp")) for inputs, labels in batches]
        return batches

    def count_global_tokens(self, batches) -> torch.Tensor:
        """Valid (non-ignored) label tokens of the whole global batch: every microbatch, every data
        rank; one count per loss term (the main head, then each MTP depth: `count_tokens`)."""
        local = sum(count_tokens(labels, self.mtp_depth) for _, labels in batches)
        dp_mesh = self.dims.mesh("dp_cp")
        if dp_mesh is not None:
            with self.watch.phase("all_reduce (token count)"), self.stragglers.waiting():
                dist.all_reduce(local, group=dp_mesh.get_group())
        if self.ft is not None:  # and over the replica groups that take part in this step
            with self.watch.phase("fault tolerance: token count"):
                self.ft.all_reduce_sum(local)
        return local

    @contextlib.contextmanager
    def train_context(self, global_tokens: torch.Tensor):
        """Everything that wraps a step's forward and backward passes: the loss normalisation
        by the global token count, loss parallel under TP (vocab-sharded logits), and bf16
        autocast where FSDP's mixed precision is absent (one GPU, TP or PP without FSDP)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.loss_fn.normalized_by(global_tokens))
            if self.dims.tp_enabled and not self.cfg.parallelism.disable_loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())
            stack.enter_context(autocast_context(self.precision, self.device.type))
            yield

    def forward_kwargs(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict:
        """Extra model-forward arguments: multi-token prediction embeds tokens from the labels;
        document masking passes each document's positions and ids (trainer/data/masking.py)."""
        return {**({"mtp_labels": labels} if self.mtp_depth else {}), **self.model_inputs(inputs)}

    def forward_backward(self, batches) -> torch.Tensor:
        """Runs every microbatch's forward and backward (or the pipeline schedule); returns
        this rank's summed normalised loss terms [main, MTP depths...] (`loss.token_terms`;
        0 on pipeline ranks without the last stage)."""
        loss_sum = torch.zeros(1 + self.mtp_depth, device=self.device, dtype=torch.float32)
        for inputs, labels in batches:
            if self.pp_schedule is not None:
                losses: list[torch.Tensor] = []
                targets = labels if self.has_last_stage else None
                stage_inputs = (inputs,) if self.has_first_stage else ()
                self.pp_schedule.step(*stage_inputs, target=targets, losses=losses,
                                      **self.forward_kwargs(inputs, labels))
                for loss in losses:
                    loss_sum += loss.token_terms
            else:
                model = self.model_parts[0]
                with chunked_ce_labels(model, labels):  # no reference to the logits outlives the loss
                    loss = self.loss_fn(model(inputs, **self.forward_kwargs(inputs, labels)), labels)
                loss.backward()
                loss_sum += loss.token_terms
        return loss_sum

    def train_step(self, batches, *, with_metrics: bool = True) -> StepResult:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        with self.train_context(self.count_global_tokens(batches)), self.watch.phase("forward/backward"):
            loss_sum = self.forward_backward(batches)
        params = [p for part in self.model_parts for p in part.parameters()]
        with self.watch.phase("gradient placements"):
            settle_gradient_placements(params)
        if self.ft is not None:  # the HSDP replicate all-reduce, across replica groups (and the loss terms)
            with self.watch.phase("fault tolerance: gradient sum"):
                self.ft.reduce_gradients(params, loss_sum)
        with self.watch.phase("grad-norm all_reduce"):
            grad_norm = clip_grad_norm_(
                params, self.cfg.training.max_norm,
                pp_group=self.dims.mesh("pp").get_group() if self.dims.pp_enabled else None)
        lr = self.lr_schedulers[0].get_last_lr()[0]  # the rate this step's update uses
        flags = [float(self.preemption.requested()), self.checkpointer.boundary_busy_flag()]
        step_time = self.stragglers.slots(with_metrics)  # log steps: every rank's step time rides along
        committed = self.ft is None or self.ft.should_commit()  # torchft: every collective of the step succeeded
        # [loss terms..., stop, busy, (step time per rank), norm]: the same on every rank, one host sync per step.
        with self.watch.phase("all_reduce (loss)"), self.stragglers.waiting():
            scalars = torch.cat([self.reduce_loss_and_flags(loss_sum, flags, step_time).double(),
                                 grad_norm.double().reshape(1)])
            # The guard decides on the device where the optimizers are fused (the update is launched
            # before the host read); otherwise the host read moves before the update.
            on_device = committed and self.guard.enabled and self.guard.decides_on_device(self.optimizers)
            if on_device:
                self.guard.step_on_device(self.optimizers, self.guard.skip_flag(scalars, loss_sum.numel()))
            values = scalars.tolist() if self.guard.enabled else None
        skipped = None if committed else "not committed by the replica groups"
        if self.guard.enabled and committed:  # global losses and norm, the same on every rank: no collective
            losses, norm = values[:loss_sum.numel()], values[-1]
            loss = losses[0] if all(math.isfinite(v) for v in losses[1:]) else math.nan  # MTP terms count too
            skipped = self.guard.check(self.step, loss, norm, log=self.rank == 0)
        extra: dict[str, float] = {}
        if skipped is None:
            self.watch.at("optimizer step")
            if not on_device:
                for opt in self.optimizers:
                    opt.step()
            for sched in self.lr_schedulers:
                sched.step()
            if self.cfg.float8.enable:  # the next forward's float8 weight scales, in one all-reduce
                from parallelisms.float8 import precompute_float8_scales

                precompute_float8_scales(self.model_parts, self.cfg.float8)
            # Model-specific hook (MoE bias update); its metrics (expert load) come back explicitly.
            if self.spec.post_optimizer_step_fn is not None:
                for part in self.model_parts:
                    extra.update(self.spec.post_optimizer_step_fn(part, self.dims, with_metrics=with_metrics) or {})
        elif self.spec.skipped_step_fn is not None:  # a skipped step leaves no trace (MoE: its loads)
            for part in self.model_parts:
                self.spec.skipped_step_fn(part)
        if self.guard.total_skipped:
            extra["skipped_steps"] = float(self.guard.total_skipped)
        with self.watch.phase("all_reduce (loss)"), self.stragglers.waiting():
            values = values or scalars.tolist()
        n = loss_sum.numel()
        losses, (stop, busy), norm = values[:n], values[n:n + 2], values[-1]
        if step_time is not None:
            extra.update(self.stragglers.observe(values[n + 2:-1], self.step))
        if self.mtp_depth:
            extra["mtp_loss"] = sum(losses[1:]) / self.mtp_depth
        if self.ft is not None:
            extra["ft/groups"] = float(self.ft.participants)
        return StepResult(loss=losses[0], grad_norm=norm, lr=lr, extra_metrics=extra, skipped=skipped,
                          stop=stop > 0, save_busy=busy > 0, committed=committed)

    def reduce_loss_and_flags(self, loss_sum: torch.Tensor, flags: list[float],
                              step_time: float | None = None) -> torch.Tensor:
        """[loss terms..., stop, busy, (step time of rank 0..N-1)] summed over every rank in one
        all-reduce (the step times on log steps: each rank fills its own slot). The loss is the
        global mean over valid tokens: the sum of every (pp, dp_cp) coordinate's terms (pipeline
        ranks without the last stage hold 0; TP ranks hold the same loss, so only TP rank 0's
        counts), which separate PP and DP all-reduces gave before. A flag summed over ranks is > 0
        iff some rank raised it: the preemption check and the async-save agreement ride along
        instead of taking an all-reduce (and a host sync) of their own."""
        if self.dims.tp_enabled and self.dims.mesh("tp").get_local_rank() != 0:
            loss_sum = torch.zeros_like(loss_sum)
        # Filled on the device from Python scalars: a host-to-device copy would sync the stream.
        parts = [loss_sum, *(loss_sum.new_full((1,), f) for f in flags)]
        if step_time is not None:
            slots = loss_sum.new_zeros(dist.get_world_size())
            slots[self.rank] = step_time  # a fill kernel, no copy
            parts.append(slots)
        packed = torch.cat(parts)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed)
        return packed

    def train(self) -> list[float]:
        cfg, t = self.cfg, self.cfg.training
        if cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save_model_only(0)
            logger.info(f"seed checkpoint written to {self.checkpointer.folder / 'step-0'}")
            return []
        losses = []
        snapshotter = MemorySnapshotter(cfg.profiling, cfg.job.dump_folder, self.rank, self.device)
        tokens_per_step = t.local_batch_size * t.seq_len * self.grad_accum_steps
        first_step = True
        with maybe_profile(cfg.profiling, cfg.job.dump_folder, self.rank, self.step) as profiler:
            while self.step < t.steps:
                with self.watch.phase("fault tolerance: quorum"):
                    try:
                        healed = self.ft is not None and self.ft.start_step()
                    except StopRequested:  # a stop signal while no quorum formed: stop at this boundary
                        self.stop_on_signal()
                        break
                if healed and self.step >= t.steps:  # healed: this group stands at a live peer's step
                    break
                self.step += 1
                self.stragglers.start_step()
                self.watch.set_step(self.step)
                if self.step % t.gc_freq == 0:
                    gc.collect(1)
                last = self.step == t.steps
                val_due = self.validator is not None and self.validator.should_run(self.step, last)
                log_now = self.metrics.should_log(self.step, last) or val_due
                try:
                    with self.watch.phase("data"):
                        inject_test_faults(self.rank, self.step)
                        # Under fault tolerance a step may not commit: then the loader goes back to
                        # here, so the step is redone on the same batches and a group healing from this
                        # one meanwhile gets the position before them, not after.
                        data_state = self.dataloader.state_dict() if self.ft is not None else None
                        batches = self.next_microbatches()
                    result = self.train_step(batches, with_metrics=log_now)
                    self.watch.at("logging and validation")
                except Exception as e:  # noqa: BLE001 - a collective that timed out: name the hung rank
                    self.watch.on_exception(e)
                    raise
                if not result.committed:
                    self.dataloader.load_state_dict(data_state)
                    self.data_iter = iter(self.dataloader)
                    logger.warning(f"fault tolerance: step {self.step} not committed (a replica group failed or "
                                   "left); redoing it with the next quorum")
                    self.step -= 1
                    continue
                losses.append(result.loss)
                self.metrics.add_tokens(tokens_per_step)
                if log_now:
                    extra = {**result.extra_metrics, **self.dataloader.metrics(),
                             **(self.validator.evaluate(self) if val_due else {})}
                    self.metrics.record(self.step, loss=result.loss, grad_norm=result.grad_norm, lr=result.lr,
                                        extra=extra)
                if self.checkpointer.should_save(self.step, last) and (self.ft is None or self.ft.is_saving_group()):
                    with self.watch.phase("checkpoint save"):
                        self.checkpointer.save(self.step, last_step=last)
                if profiler is not None:
                    profiler.step(self.step)
                snapshotter.step(self.step)
                if first_step:
                    tdist.set_collective_timeout(cfg.comm.train_timeout_seconds)
                    self.watch.arm()
                    first_step = False
                # The step's loss all-reduce also carried a stop asked of any rank, and whether an async
                # save is written everywhere (then it is committed now, not at the next save).
                if not last:
                    self.checkpointer.step_boundary(result.save_busy, self.step)
                self.watch.at("between steps")
                self.stragglers.end_step()
                if not last and result.stop:
                    self.stop_on_signal()
                    break
        return losses

    def stop_on_signal(self) -> None:
        """A stop signal (preemption), agreed by every rank: save this step and stop. Under fault
        tolerance only the saving group writes (the groups share one folder and hold the same
        state); every group then exits with the requeue code (`main`)."""
        saves = self.cfg.checkpoint.enable and (self.ft is None or self.ft.is_saving_group())
        logger.info(f"preemption signal received: {'saving a checkpoint' if saves else 'stopping'} at step "
                    f"{self.step} and exiting" + ("" if saves or not self.cfg.checkpoint.enable else
                                                  " (another replica group saves)"))
        if saves:
            self.checkpointer.save(self.step, force_sync=True)
        self.preemption.mark_preempted(self.step)

    def close(self, destroy_process_group: bool = True) -> None:
        """Finishes pending saves and flushes metrics. Test drivers that run several
        trainers in one process group pass destroy_process_group=False."""
        self.watch.close()
        if self.ft is not None:
            self.ft.close()
        self.checkpointer.close()
        self.metrics.close()
        gc.enable()
        if destroy_process_group:
            tdist.destroy()


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    cfg = main_guard(argv, world_size=tdist.world_size())
    if cfg.job.dry_run:
        print_model_summary(cfg)
        return 0
    Path(cfg.job.dump_folder).mkdir(parents=True, exist_ok=True)
    try:
        trainer = Trainer(cfg)
    except (ConfigError, CheckpointError) as e:
        tdist.destroy()
        return report_user_error(str(e))
    try:
        trainer.train()
    finally:
        trainer.close()
    # A replica group stopped by a preemption signal says so (scripts/ft_trainer.slurm requeues or restarts it).
    return PREEMPTED_EXIT if trainer.preemption.stopped_at is not None and cfg.fault_tolerance.enable else 0


if __name__ == "__main__":
    tdist.exit_process(run_entry_point(main))
