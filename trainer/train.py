"""The training loop: build -> loop -> close. Run with `python -m trainer.train` (under torchrun).

How a step flows: pull every microbatch of the step, count the valid tokens over
the whole global batch, run forward/backward per microbatch (or the pipeline
schedule) with each loss divided by that global count, clip the gradient norm
across every mesh dimension, step the optimizer and LR schedule, run the model's
post-step hook (MoE bias update), then log, checkpoint and profile.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from models.common.moe import set_aux_loss_sequences
from parallelisms.grad_clip import clip_grad_norm_
from parallelisms.parallel_dims import ParallelDims
from trainer import distributed as tdist
from trainer.checkpoint import CheckpointError, Checkpointer
from trainer.config import DEFAULT_TOKENIZER, JobConfig, format_config, main_guard
from trainer.configurable import ConfigError
from trainer.loss import TokenLoss, chunked_ce_loss_sum, cross_entropy_sum, install_chunked_ce_head
from trainer.hf_io import load_hf_weights
from trainer.metrics import MetricsLogger
from trainer.model_args import check_tokenizer_fits, describe_args, model_label, resolve_model, tokenizer_path
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.preemption import PreemptionHandler
from trainer.profiling import MemorySnapshotter, maybe_profile

logger = logging.getLogger("trainer")


def setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)


def build_model_on_meta(cfg: JobConfig):
    spec, args = resolve_model(cfg)
    with torch.device("meta"):
        model = spec.model_cls(args)
    return spec, args, model


def dry_run(cfg: JobConfig) -> dict[str, float]:
    """Builds the model on the meta device (no allocation) and prints what a user checks before renting GPUs."""
    spec, args, model = build_model_on_meta(cfg)
    summary = spec.summary_fn(model, args, cfg.training.seq_len)
    print(format_config(cfg))
    print(f"model: {model_label(cfg)}")
    print(f"model args: {describe_args(args)}")
    print(f"parameters: {int(summary['params']):,}")
    if "activated_params" in summary:
        print(f"activated parameters: {int(summary['activated_params']):,}")
    print(f"FLOPs/token (seq_len {cfg.training.seq_len}): {summary['flops_per_token']:,.0f}")
    return summary


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        t = cfg.training
        # First, so that a preemption signal during start-up is remembered, not fatal.
        self.preemption = PreemptionHandler()
        self.device = tdist.pick_device(t.device)
        self.backend = tdist.init_distributed(self.device, cfg.comm.init_timeout_seconds)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.dims = ParallelDims.from_config(cfg.parallelism, tdist.world_size())
        self.spec, self.model_args = resolve_model(cfg)
        self.dims.validate_model(self.model_args, t.seq_len,
                                 cfg.parallelism.enable_sequence_parallel and self.dims.tp_enabled)
        self.dims.build_mesh(self.device.type)
        tdist.set_seed(t.seed, t.deterministic)
        self.param_dtype = tdist.resolve_dtype(t.mixed_precision_param, self.device, t.mixed_precision_on_cpu)
        self.reduce_dtype = tdist.resolve_dtype(t.mixed_precision_reduce, self.device, t.mixed_precision_on_cpu)
        # Without FSDP (one GPU) its MixedPrecisionPolicy is absent: autocast gives the same bf16 compute.
        self.autocast_dtype = self.param_dtype if self.dims.fsdp_mesh() is None else torch.float32

        # ---- batch layout ----
        self.dp_degree, self.dp_rank = self.dims.dp_degree, self.dims.coordinate("dp")
        per_step_local = t.local_batch_size * self.dp_degree
        global_bs = t.global_batch_size if t.global_batch_size > 0 else per_step_local
        if global_bs % per_step_local != 0:
            raise ConfigError(
                f"config error: training.global_batch_size: {global_bs} is not a multiple of local_batch_size "
                f"({t.local_batch_size}) x data-parallel degree ({self.dp_degree}) = {per_step_local}; use a multiple")
        self.grad_accum_steps = global_bs // per_step_local
        self.global_batch_size = global_bs

        # ---- data ----
        from trainer.data import build_dataloader
        from trainer.data.tokenizer import build_tokenizer

        self.tokenizer = build_tokenizer(tokenizer_path(cfg, DEFAULT_TOKENIZER))
        check_tokenizer_fits(self.tokenizer, self.model_args, model_label(cfg))
        self.dataloader = build_dataloader(
            dataset=t.dataset, dataset_path=t.dataset_path, tokenizer=self.tokenizer, seq_len=t.seq_len,
            local_batch_size=t.local_batch_size, dp_rank=self.dp_rank, dp_world_size=self.dp_degree, seed=t.seed)

        # ---- model: meta -> [PP split] -> TP -> AC -> compile -> FSDP -> materialise ----
        with torch.device("meta"):
            model = self.spec.model_cls(self.model_args)
        summary = self.spec.summary_fn(model, self.model_args, t.seq_len)
        # loss.chunked_ce: the output Linear becomes a head that computes the loss (same params/FQNs).
        self.chunked_ce = install_chunked_ce_head(model, cfg.loss)
        self.mtp_depth = getattr(self.model_args, "mtp_depth", 0)
        self.token_loss = self.build_token_loss()
        self.num_params, self.flops_per_token = summary["params"], summary["flops_per_token"]
        self.pp_schedule = None
        self.has_first_stage = self.has_last_stage = True
        if self.dims.pp_enabled:
            from parallelisms.pipeline import build_pipeline

            self.pp_schedule, self.model_parts, self.has_first_stage, self.has_last_stage = build_pipeline(
                model, self.spec, self.dims, cfg, self.loss_fn, self.device, self.parallelize_part)
        else:
            self.model_parts = [self.parallelize_part(model)]
        # Each shard draws from its own stream (replicas share one), so shards are not copies
        # of each other; runs that must match across layouts start from a seed checkpoint.
        torch.manual_seed(t.seed + self.dims.shard_seed_offset())
        for part in self.model_parts:
            part.to_empty(device=self.device)
            with torch.no_grad():
                part.init_weights(buffer_device=self.device)
            part.train()
        tdist.set_seed(t.seed, t.deterministic)
        # MoE balance loss: one mean over the sequences of the global batch (a no-op without MoE).
        set_aux_loss_sequences(self.model_parts, self.global_batch_size)

        # ---- optimizer, schedule, checkpoint, metrics ----
        self.optimizers = [build_optimizer(p.parameters(), cfg.optimizer, self.device.type) for p in self.model_parts]
        self.lr_schedulers = [build_lr_scheduler(o, t.steps, cfg.lr_scheduler) for o in self.optimizers]
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.job.dump_folder, model_parts=self.model_parts,
                                         optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
                                         dataloader=self.dataloader, dp_rank=self.dp_rank)
        if cfg.checkpoint.create_seed_checkpoint:
            if tdist.world_size() != 1:
                raise ConfigError("config error: checkpoint.create_seed_checkpoint: run it with one process "
                                  "(NGPU=1), so that the weights do not depend on a parallel layout")
        resuming = cfg.checkpoint.enable and self.checkpointer.resume_path() is not None
        self.step = 0 if cfg.checkpoint.create_seed_checkpoint else self.checkpointer.load()
        if cfg.model.hf_path and not resuming and not cfg.checkpoint.initial_load_path:
            # model.hf_path: the folder's weights, unless a checkpoint resumes (or initial_load_path gives others).
            load_hf_weights(self.model_parts, cfg.model.hf_path)
        # Global rank 0 logs (what run_train.sh shows by default): train_step all-reduces the
        # loss over dp and, with PP, from the last stage along the pipeline, and the grad norm
        # is global, so every rank holds the values it logs.
        self.is_logging_rank = self.rank == 0
        self.metrics = MetricsLogger(cfg.metrics, cfg.job.dump_folder, enabled=self.is_logging_rank,
                                     device=self.device, flops_per_token=self.flops_per_token,
                                     non_data_parallel_size=self.dims.non_data_parallel_size)
        self.data_iter = iter(self.dataloader)
        gc.disable()
        if self.rank == 0:
            logger.info(f"model {model_label(cfg)}: {self.num_params:,} params, "
                        f"{self.flops_per_token:,.0f} FLOPs/token; world {tdist.world_size()} "
                        f"(dp_replicate {self.dims.dp_replicate}, dp_shard {self.dims.dp_shard}, tp {self.dims.tp}, "
                        f"pp {self.dims.pp}, ep {self.dims.ep}); {self.device.type}/{self.backend or 'single'}, "
                        f"param dtype {self.param_dtype}; global batch {self.global_batch_size} = local "
                        f"{t.local_batch_size} x dp {self.dp_degree} x accum {self.grad_accum_steps}; "
                        f"AC {cfg.activation_checkpoint.mode}, compile {cfg.compile.enable}; "
                        f"starting at step {self.step}")

    # ---- model assembly (one model part) ----
    def parallelize_part(self, part: nn.Module) -> nn.Module:
        cfg = self.cfg
        if self.dims.tp_enabled:
            if self.spec.tensor_parallel_fn is None:
                raise ConfigError(f"config error: parallelism.tensor_parallel_degree: {cfg.model.name} has no "
                                  "TP plan; set it to 1")
            self.spec.tensor_parallel_fn(part, self.dims.mesh("tp"), cfg.parallelism)
        if self.dims.ep_enabled:
            if self.spec.expert_parallel_fn is None:
                raise ConfigError(f"config error: parallelism.expert_parallel_degree: {cfg.model.name} has no "
                                  "experts; set it to 1")
            self.spec.expert_parallel_fn(part, self.dims, cfg.parallelism)
        if cfg.activation_checkpoint.mode != "none":
            from parallelisms.activation_checkpoint import apply_activation_checkpointing

            apply_activation_checkpointing(
                part, cfg.activation_checkpoint, extra_save_ops=self.spec.sac_save_ops,
                force_recompute_fqns=tuple(self.spec.sac_force_recompute_fqns), compile_enabled=cfg.compile.enable)
        if cfg.compile.enable:
            from parallelisms.compile import apply_compile

            apply_compile(part, cfg.compile, cfg.activation_checkpoint)
        dp_mesh = self.dims.fsdp_mesh()
        if dp_mesh is not None:
            from parallelisms.fsdp import apply_fsdp

            apply_fsdp(part, dp_mesh, param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                       reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
                       pp_enabled=self.dims.pp_enabled, cpu_offload=cfg.parallelism.fsdp_cpu_offload,
                       backend=self.backend or "nccl")
        return part

    # ---- loss ----
    def build_token_loss(self) -> TokenLoss:
        """Summed token losses / global valid tokens (trainer/loss.py), MTP depths included."""
        ce = cross_entropy_sum
        if self.dims.tp_enabled and not self.cfg.parallelism.disable_loss_parallel:
            # Logits are vocab-sharded DTensors; the helper also runs the loss's backward
            # under loss_parallel, wherever that backward is called (here or in a PP schedule).
            from parallelisms.tensor_parallel import loss_parallel_loss

            ce = functools.partial(loss_parallel_loss, cross_entropy_sum)
        return TokenLoss(self.mtp_depth, self.cfg.loss.mtp_weight, ce)

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.token_loss(logits, labels)

    def forward_kwargs(self, labels: torch.Tensor) -> dict:
        """Extra model-forward arguments: multi-token prediction embeds tokens from the labels."""
        return {"mtp_labels": labels} if self.mtp_depth else {}

    # ---- one optimizer step ----
    def next_microbatches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [tuple(x.to(self.device, non_blocking=True) for x in next(self.data_iter))
                for _ in range(self.grad_accum_steps)]

    def autocast(self):
        """bf16 compute without FSDP (one GPU, or CPU when asked); a no-op in fp32 and under FSDP."""
        return torch.autocast(self.device.type, dtype=self.autocast_dtype,
                              enabled=self.autocast_dtype != torch.float32)

    def train_step(self, batches) -> tuple[float, float]:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        dp_mesh = self.dims.mesh("dp_cp")
        self.token_loss.start_step(batches, dp_mesh.get_group() if dp_mesh is not None else None)
        loss_sum = self.token_loss.zero_terms(self.device)  # [main, MTP depths...], see TokenLoss
        if self.pp_schedule is not None:
            for inputs, labels in batches:
                losses: list[torch.Tensor] = []
                targets = labels if self.has_last_stage else None
                if self.has_first_stage:
                    self.pp_schedule.step(inputs, target=targets, losses=losses, **self.forward_kwargs(labels))
                else:
                    self.pp_schedule.step(target=targets, losses=losses, **self.forward_kwargs(labels))
                for loss in losses:
                    loss_sum += loss.token_terms
            # Only the last stage holds the loss; share it along the pipeline so every rank reports it.
            dist.all_reduce(loss_sum, group=self.dims.mesh("pp").get_group())
        else:
            model = self.model_parts[0]
            for inputs, labels in batches:
                with self.autocast():
                    if self.chunked_ce:  # the head computes the summed loss while FSDP has its weight gathered
                        loss = self.token_loss.scaled_main(chunked_ce_loss_sum(model, inputs, labels))
                    else:
                        loss = self.loss_fn(model(inputs, **self.forward_kwargs(labels)), labels)
                loss.backward()
                loss_sum += loss.token_terms
        grad_norm = clip_grad_norm_(
            [p for part in self.model_parts for p in part.parameters()], self.cfg.training.max_norm,
            pp_group=self.dims.mesh("pp").get_group() if self.dims.pp_enabled else None)
        for opt in self.optimizers:
            opt.step()
        for sched in self.lr_schedulers:
            sched.step()
        # Model-specific extra metrics (MoE expert load), read before the hook zeroes its counters.
        self.step_extra_metrics: dict[str, float] = {}
        if self.spec.post_optimizer_step_fn is not None:
            for part in self.model_parts:
                self.step_extra_metrics.update(self.spec.post_optimizer_step_fn(part, self.dims) or {})
        # The logged loss is the global mean over valid tokens (the main head's; MTP depths apart).
        if dp_mesh is not None:
            dist.all_reduce(loss_sum, group=dp_mesh.get_group())
        if self.mtp_depth:
            self.step_extra_metrics["mtp_loss"] = loss_sum[1:].mean().item()
        return loss_sum[0].item(), float(grad_norm.item())

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
                self.step += 1
                if self.step % t.gc_freq == 0:
                    gc.collect(1)
                batches = self.next_microbatches()
                loss, grad_norm = self.train_step(batches)
                losses.append(loss)
                last = self.step == t.steps
                self.metrics.add_tokens(tokens_per_step)
                if self.metrics.should_log(self.step, last):
                    self.metrics.record(self.step, loss=loss, grad_norm=grad_norm,
                                        lr=self.lr_schedulers[0].get_last_lr()[0],
                                        extra=getattr(self, "step_extra_metrics", None))
                if self.checkpointer.should_save(self.step, last):
                    self.checkpointer.save(self.step, last_step=last)
                if profiler is not None:
                    profiler.step(self.step)
                snapshotter.step(self.step)
                if first_step:
                    tdist.set_collective_timeout(cfg.comm.train_timeout_seconds)
                    first_step = False
                if not last and self.preemption.should_stop(self.device):
                    logger.info(f"preemption signal received: saving a checkpoint at step {self.step} and exiting")
                    if cfg.checkpoint.enable:
                        self.checkpointer.save(self.step, force_sync=True)
                    self.preemption.mark_preempted(self.step)
                    break
        return losses

    def close(self, destroy_process_group: bool = True) -> None:
        """Finishes pending saves and flushes metrics. Test drivers that run several
        trainers in one process group pass destroy_process_group=False."""
        self.checkpointer.close()
        self.metrics.close()
        gc.enable()
        if destroy_process_group:
            tdist.destroy()


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    cfg = main_guard(argv)
    if cfg.job.dry_run:
        dry_run(cfg)
        return 0
    Path(cfg.job.dump_folder).mkdir(parents=True, exist_ok=True)
    try:
        trainer = Trainer(cfg)
    except (ConfigError, CheckpointError) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(str(e), file=sys.stderr)
        tdist.destroy()
        return 2
    try:
        trainer.train()
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
