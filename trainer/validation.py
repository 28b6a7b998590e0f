"""Validation: a held-out loss every `freq` steps, on every data-parallel rank.

The split is either its own sources (`validation.sources`, same tables as data.sources)
or the last `holdout` fraction of every training source's windows, which training then
never sees. Each evaluation reads the same `steps` batches per rank from the start of
the split (so successive values are comparable), runs the forward only under no_grad
and in eval mode (MoE layers then leave out its tokens from the expert loads that drive
the next routing-bias update: that update sees training forwards only), and reduces the
summed token loss and the token count over dp and CP (each CP rank holds its own chunks
of every sequence, cut as in training): val/loss is the mean over all valid tokens,
val/perplexity its exp.

The forward is the trainer's: `model_loss_sum(trainer, inputs, labels)` calls the model
(or, under pipeline parallelism, the schedule's forward-only `eval`, the loss arriving
on the last stage and shared along the pipeline) with the trainer's loss function, so
tensor parallel loss, chunked cross entropy, FSDP and autocast apply exactly as in
training.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from configuration.fields import ConfigError, opt

logger = logging.getLogger("trainer")
VALIDATION_SEED_OFFSET = 1_000_003  # a synthetic validation source must not replay training's samples


@dataclass
class ValidationConfig:
    """[validation]"""

    enable: bool = opt(False, "Evaluate a held-out loss during training (val/loss, val/perplexity).")
    freq: int = opt(100, "Evaluate every N steps, and after the last step.", min=1)
    steps: int = opt(10, "Batches of training.local_batch_size per dp rank in each evaluation.", min=1)
    sources: list[Any] = opt([], "Held-out sources ([[validation.sources]] tables, as data.sources). Empty: hold "
                             "out the last validation.holdout of every training source.")
    holdout: float = opt(0.01, "Fraction of each training source's windows held out when validation.sources is "
                         "empty (training then skips them).", min=0.0, max=0.5)

    def specs(self, data) -> list:
        from trainer.data.config import parse_sources

        return parse_sources(self.sources, "validation.sources", data) if self.sources else data.source_specs()

    def validate(self, root) -> None:
        if not self.enable:
            return
        self.specs(root.data)
        if not self.sources and self.holdout <= 0:
            raise ConfigError("config error: validation.holdout: 0 with no validation.sources leaves nothing to "
                              "validate on; set validation.holdout (e.g. 0.01) or validation.sources")


def training_holdout(cfg: ValidationConfig) -> float:
    """The fraction the training loader must leave out for validation."""
    return cfg.holdout if cfg.enable and not cfg.sources else 0.0


def build_validator(cfg, tokenizer, tokenizer_path: str, dp_rank: int, dp_world_size: int,
                    dp_mesh) -> "Validator | None":
    """The job's Validator (None when validation is off)."""
    if not cfg.validation.enable:
        return None
    t = cfg.training
    return Validator(cfg.validation, cfg.data, tokenizer=tokenizer, tokenizer_path=tokenizer_path,
                     seq_len=t.seq_len, local_batch_size=t.local_batch_size, dp_rank=dp_rank,
                     dp_world_size=dp_world_size, seed=t.seed, dp_mesh=dp_mesh)


class Validator:
    """Builds the validation loader of this dp rank and computes val/loss on demand."""

    def __init__(self, cfg: ValidationConfig, data, *, tokenizer, tokenizer_path: str, seq_len: int,
                 local_batch_size: int, dp_rank: int, dp_world_size: int, seed: int, dp_mesh=None):
        from trainer.data import build_dataloader

        self.cfg = cfg
        self.dp_group = dp_mesh.get_group() if dp_mesh is not None else None
        self.loader = build_dataloader(data, tokenizer=tokenizer, tokenizer_path=tokenizer_path, seq_len=seq_len,
                                       local_batch_size=local_batch_size, dp_rank=dp_rank,
                                       dp_world_size=dp_world_size, seed=seed + VALIDATION_SEED_OFFSET,
                                       specs=cfg.specs(data), holdout=0.0 if cfg.sources else cfg.holdout,
                                       part="validation", num_workers=0)
        self._initial_state = self.loader.state_dict()

    def should_run(self, step: int, last_step: bool) -> bool:
        return self.cfg.enable and (step % self.cfg.freq == 0 or last_step)

    def batches(self):
        """The split's first `steps` batches of this rank (the same ones every evaluation)."""
        self.loader.load_state_dict(self._initial_state)
        it = iter(self.loader)
        return [next(it) for _ in range(self.cfg.steps)]

    def evaluate(self, trainer) -> dict[str, float]:
        """Runs the evaluation through the trainer's model and logs it on the logging rank."""
        prepare = None
        if trainer.dims.cp > 1:  # as in training: each CP rank keeps its two chunks of every sequence
            from parallelisms.context_parallel import shard_microbatch

            prepare = lambda x, y: shard_microbatch(x, y, trainer.dims.mesh("cp"))  # noqa: E731
        with trainer.metrics.paused(), eval_mode(trainer.model_parts):
            metrics = self.run(lambda x, y: model_loss_sum(trainer, x, y), trainer.device, prepare=prepare)
        if trainer.is_logging_rank:
            logger.info(f"validation {trainer.step:>6} | val/loss {metrics['val/loss']:8.4f} | "
                        f"val/perplexity {metrics['val/perplexity']:10.3f}")
        return metrics

    def run(self, loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
            ignore_index: int = -100, prepare: Callable | None = None) -> dict[str, float]:
        """val/loss (mean token loss over all dp ranks) and val/perplexity; `prepare` maps a
        batch to what this rank feeds the model (its CP shard)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        with torch.no_grad():
            for inputs, labels in self.batches():
                inputs, labels = inputs.to(device), labels.to(device)
                if prepare is not None:
                    inputs, labels = prepare(inputs, labels)
                total += loss_sum(inputs, labels).to(torch.float64)
                count += (labels != ignore_index).sum().to(torch.float64)
        if self.dp_group is not None:
            stacked = torch.stack([total, count])
            dist.all_reduce(stacked, group=self.dp_group)
            total, count = stacked[0], stacked[1]
        loss = (total / count.clamp_min(1)).item()
        return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 700.0))}


@contextlib.contextmanager
def eval_mode(parts):
    """The model parts in eval mode for the duration (train mode again after, as training left them)."""
    modes = [(m, m.training) for part in parts for m in part.modules()]
    for part in parts:
        part.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def model_loss_sum(trainer, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed token loss of one batch through the trainer's model parts, forward only,
    inside the trainer's own train_context (normalised by 1, so the loss is the sum). With
    multi-token prediction this is the main head's loss (`token_terms[0]`), as logged."""
    from trainer.loss import chunked_ce_labels

    one = torch.ones((), device=inputs.device)
    kwargs = trainer.forward_kwargs(inputs, labels)
    with trainer.train_context(one):
        if trainer.pp_schedule is not None:
            losses: list[torch.Tensor] = []
            targets = labels if trainer.has_last_stage else None
            stage_inputs = (inputs,) if trainer.has_first_stage else ()
            trainer.pp_schedule.eval(*stage_inputs, target=targets, losses=losses, **kwargs)
            out = torch.zeros((), device=inputs.device)
            for loss in losses:
                out += loss.token_terms[0].float()
            dist.all_reduce(out, group=trainer.dims.mesh("pp").get_group())
            return out
        model = trainer.model_parts[0]
        with chunked_ce_labels(model, labels):
            loss = trainer.loss_fn(model(inputs, **kwargs), labels)
        return loss.token_terms[0].float()
