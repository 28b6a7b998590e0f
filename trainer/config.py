"""The root config: small per-component sections, TOML, then `--section.key value`.

Precedence: dataclass defaults < TOML file < command line. Every section is a
dataclass owned by the component that reads it; this module only composes them,
loads them and checks them. Any bad input raises `ConfigError`, whose message is
one line naming the key; `python -m trainer.train` prints it and exits 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallelisms.activation_checkpoint import ActivationCheckpointConfig
from parallelisms.compile import CompileConfig
from parallelisms.float8 import Float8Config
from parallelisms.parallel_dims import ParallelismConfig
from trainer.checkpoint_config import CheckpointConfig
from configuration.fields import ConfigError, field_docs, opt, set_field
from configuration.environment import global_rank
from trainer.data.config import NEEDS_PATH, DataConfig
from trainer.fault_tolerance.config import FaultToleranceConfig
from trainer.loss import LossConfig
from trainer.metrics import MetricsConfig
from trainer.model_args import MoEConfig, check_hf_export, describe_args, model_label, resolve_model
from trainer.optim import LRSchedulerConfig, OptimizerConfig
from trainer.profiling import ProfilingConfig
from trainer.validation import ValidationConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "train_configs"
DEFAULT_TOKENIZER = str(REPO_ROOT / "assets" / "tokenizer" / "tokenizer.model")


@dataclass
class JobSection:
    """[job]"""

    config_file: str | None = opt(None, "TOML file; a bare name is looked up in train_configs/.")
    dump_folder: str = opt("./outputs", "Where checkpoints, metrics.jsonl, TensorBoard events and traces go.")
    description: str = opt("", "Free text, printed at start.")
    dry_run: bool = opt(False, "Build the model on the meta device, print config, params and FLOPs/token, exit.")


@dataclass
class ModelSection:
    """[model]"""

    name: str | None = opt(None, "Model spec name (see models/__init__.py). Default: llama3, or what "
                           "model.hf_path's config.json holds (its model_type).")
    flavor: str | None = opt(None, "Flavor of the model spec, e.g. debug, 8B, 70B. Default: debug; with "
                             "model.hf_path the shape comes from config.json (a flavor given as well must match).")
    hf_path: str | None = opt(None, "Hugging Face model folder (config.json + safetensors, FP8 included): the "
                              "model name, shape, initial weights and tokenizer all come from it. The weights "
                              "load when there is no checkpoint to resume from; checkpoint.enable is not needed.")
    tokenizer_path: str | None = opt(None, "Tokenizer: an HF tokenizer.json, a tiktoken BPE file (base64 token + "
                                     "rank per line, e.g. Llama 3's original/tokenizer.model), or a folder with "
                                     "one. Default: model.hf_path's own, else the repo's debug tokenizer.")
    mtp_depth: int = opt(0, "DeepSeek V3 multi-token prediction: MTP modules after the main model, each "
                         "predicting one token further; trained with loss.mtp_weight. 0 = off.", min=0)


@dataclass
class TrainingSection:
    """[training]"""

    steps: int = opt(300, "Optimizer steps to train.", min=1)
    seq_len: int = opt(256, "Tokens per sample.", min=2)
    local_batch_size: int = opt(8, "Samples per microbatch on each data-parallel rank.", min=1)
    global_batch_size: int = opt(-1, "Samples per optimizer step over all data-parallel ranks; a multiple of "
                                 "local_batch_size x dp gives gradient accumulation. -1 = local x dp.", min=-1)
    max_norm: float = opt(1.0, "Gradient-norm clipping threshold; 0 disables clipping.", min=0.0)
    seed: int = opt(42, "Seed for init and data order.", min=0)
    deterministic: bool = opt(False, "torch.use_deterministic_algorithms and deterministic cuDNN/cuBLAS.")
    gc_freq: int = opt(50, "Run Python's garbage collector every N steps (automatic GC is disabled).", min=1)
    mixed_precision_param: str = opt("bfloat16", "Compute dtype of params under FSDP; falls back to float32 on CPU "
                                     "unless mixed_precision_on_cpu.", choices=("bfloat16", "float32"))
    mixed_precision_reduce: str = opt("float32", "Gradient reduce dtype under FSDP.", choices=("float32", "bfloat16"))
    mixed_precision_on_cpu: bool = opt(False, "Also use mixed_precision_param on CPU (slow, for tests).")
    device: str = opt("auto", "auto (CUDA if available, else CPU), cuda or cpu.", choices=("auto", "cuda", "cpu"))
    max_skipped_steps: int = opt(3, "Skip a step whose loss or gradient norm is not finite (no optimizer update); "
                                 "stop the run after this many in a row. 0 turns the guard off.", min=0)
    loss_spike_factor: float = opt(0.0, "Also skip a step whose loss exceeds this many times the mean of the "
                                   "last 20 accepted losses (> 1, with training.max_skipped_steps > 0); 0 = off.",
                                   min=0.0)

    def validate(self, root) -> None:
        if self.loss_spike_factor and (self.loss_spike_factor <= 1 or self.max_skipped_steps == 0):
            why = ("is read only by the guard, which training.max_skipped_steps = 0 turns off"
                   if self.loss_spike_factor > 1 else "must exceed 1 (at or below the mean, most steps would be skipped)")
            raise ConfigError(f"config error: training.loss_spike_factor: {self.loss_spike_factor:g} {why}; "
                              "set it above 1 with training.max_skipped_steps > 0, or to 0")


@dataclass
class CommSection:
    """[comm]"""

    init_timeout_seconds: int = opt(300, "Timeout for process-group init and the first collectives.", min=1)
    train_timeout_seconds: int = opt(120, "Timeout for collectives after the first step.", min=1)


@dataclass
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    comm: CommSection = field(default_factory=CommSection)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    # Resolved by validate(): the one lookup of the model (see trainer/model_args.py).
    model_spec: Any = field(default=None, init=False, repr=False, compare=False, metadata={"section": False})
    model_args: Any = field(default=None, init=False, repr=False, compare=False, metadata={"section": False})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def validate(self, world_size: int | None = None) -> None:
        """Cross-field checks, once: resolve the model, then each section's `validate(root)`,
        then, when the world size is known, the layout against it (`ParallelDims`)."""
        self.model_spec, self.model_args = resolve_model(self)
        check_hf_export(self)
        if self.model.hf_path and self.checkpoint.initial_load_path and not self.checkpoint.enable:
            raise ConfigError("config error: checkpoint.initial_load_path: read only with checkpoint.enable = true "
                              "(model.hf_path alone loads the folder's weights); set --checkpoint.enable true or "
                              "drop it")
        max_seq = getattr(self.model_args, "max_seq_len", None)
        if max_seq is not None and self.training.seq_len > max_seq:
            raise ConfigError(f"config error: training.seq_len: {self.training.seq_len} exceeds the model's "
                              f"max_seq_len {max_seq}; lower training.seq_len")
        for name in SECTIONS:
            section = getattr(self, name)
            if hasattr(section, "validate"):
                section.validate(self)
        if world_size is not None:
            from parallelisms.parallel_dims import ParallelDims

            dims = ParallelDims.from_config(self.parallelism, world_size)
            fsdp_only = [k for k, on in (("parallelism.fsdp_cpu_offload", self.parallelism.fsdp_cpu_offload),
                                         ("float8.enable_fsdp_float8_all_gather",
                                          self.float8.enable and self.float8.enable_fsdp_float8_all_gather)) if on]
            if fsdp_only and not (dims.fsdp_enabled or dims.hsdp_enabled):
                raise ConfigError(f"config error: {fsdp_only[0]}: needs FSDP, but the layout on {world_size} "
                                  "rank(s) has data_parallel_shard_degree x context_parallel_degree = 1 and no "
                                  "replicas; use more ranks for FSDP or drop it")


# The config sections, in --help order: JobConfig's fields (listed once, above).
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)
                             if f.metadata.get("section", True)}


def resolve_config_path(name: str) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    candidate = CONFIG_DIR / path.name
    if candidate.is_file():
        return candidate
    if not candidate.suffix:
        candidate = candidate.with_suffix(".toml")
        if candidate.is_file():
            return candidate
    available = sorted(p.name for p in CONFIG_DIR.glob("*.toml"))
    close = difflib.get_close_matches(path.name, available, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ConfigError(f"config error: job.config_file: {name} not found here or in train_configs/{hint}; "
                      f"available: {', '.join(available)}")


# Keys that moved to another section: a one-line error that names the new key.
MOVED_KEYS = {"training.dataset": "data.type", "training.dataset_path": "data.path"}


def _check_moved(section: str, key: str) -> None:
    new = MOVED_KEYS.get(f"{section}.{key}")
    if new:
        raise ConfigError(f"config error: {section}.{key} moved to {new}; use {new} (see README, Data)")


def _apply_table(cfg: JobConfig, table: dict[str, Any], source: str) -> None:
    for section, values in table.items():
        if section not in SECTIONS:
            close = difflib.get_close_matches(section, list(SECTIONS), n=1)
            hint = f" (did you mean [{close[0]}]?)" if close else ""
            raise ConfigError(f"config error: unknown section [{section}] in {source}{hint}")
        if not isinstance(values, dict):
            raise ConfigError(f"config error: [{section}] in {source} must be a table of key = value")
        for key, value in values.items():
            _check_moved(section, key)
            set_field(getattr(cfg, section), section, key, value, from_cli=False)


def _parse_cli(argv: list[str]) -> list[tuple[str, str, Any]]:
    """`--section.key value`, `--section.key=value`, or a bare boolean flag."""
    out = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"config error: unexpected argument {arg!r}; overrides look like --section.key value")
        body = arg[2:]
        value: Any
        if "=" in body:
            body, value = body.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 1
        else:
            value = "true"
        if body in ("config", "config-file", "config_file"):
            body = "job.config_file"
        elif body in ("dry-run", "dry_run"):
            body = "job.dry_run"
        if "." not in body:
            raise ConfigError(f"config error: --{body}: overrides look like --section.key value; "
                              f"sections: {', '.join(SECTIONS)}")
        section, key = body.split(".", 1)
        if section not in SECTIONS:
            close = difflib.get_close_matches(section, list(SECTIONS), n=1)
            hint = f" (did you mean --{close[0]}.{key}?)" if close else ""
            raise ConfigError(f"config error: unknown section in --{body}{hint}")
        out.append((section, key.replace("-", "_"), value))
        i += 1
    return out


def duplicate_key_hint(path: Path, message: str) -> str:
    """For tomllib's "Cannot overwrite a value (at line L, column C)", which names no key:
    "; the key is training.steps, set before on line K". Empty when that cannot be told."""
    import re

    found = re.search(r"Cannot overwrite a value \(at line (\d+), column \d+\)", message)
    if not found:
        return ""
    lines = path.read_text(errors="replace").splitlines()
    target, table, seen = int(found.group(1)), "", {}
    for number, line in enumerate(lines[:target], start=1):
        text = line.strip()
        header = re.fullmatch(r"\[\[?\s*([^\]]+?)\s*\]\]?(\s*#.*)?", text)
        if header:
            table = header.group(1)
            continue
        if "=" not in text or text.startswith("#"):
            continue
        name = ".".join(part.strip().strip("\"'") for part in text.split("=", 1)[0].split("."))
        full = f"{table}.{name}" if table else name
        if number == target:
            before = f", set before on line {seen[full]}" if full in seen else ""
            return f"; the key is {full}{before}"
        seen[full] = number
    return ""


def load_config(argv: list[str] | None = None, world_size: int | None = None) -> JobConfig:
    """Builds the root config from defaults, the TOML file and the CLI, then validates it
    (the layout against `world_size` too, when given)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = _parse_cli(argv)
    cfg = JobConfig()
    config_file = next((v for s, k, v in overrides if (s, k) == ("job", "config_file")), None)
    if config_file:
        path = resolve_config_path(config_file)
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config error: {path} is not valid TOML: {e}{duplicate_key_hint(path, str(e))}") \
                from None
        _apply_table(cfg, table, str(path))
        cfg.job.config_file = str(path)
        if any((s, k) == ("model", "hf_path") for s, k, _ in overrides):
            # A command-line HF folder replaces the file's model: its name, shape and tokenizer
            # come from the folder (ones given on the command line as well are still checked).
            cfg.model.name = cfg.model.flavor = cfg.model.tokenizer_path = None
    for section, key, value in overrides:
        if (section, key) == ("job", "config_file"):
            continue
        _check_moved(section, key)
        set_field(getattr(cfg, section), section, key, value, from_cli=True)
    cli = {(s, k) for s, k, _ in overrides}
    if ("data", "type") in cli and ("data", "path") not in cli and cfg.data.type not in NEEDS_PATH:
        cfg.data.path = None  # e.g. --data.type synthetic replaces the file's tokens folder
    cfg.validate(world_size)
    return cfg


def help_text() -> str:
    lines = ["usage: ./run_train.sh [--config NAME.toml] [--dry-run] [--section.key value ...]", "",
             "Precedence: defaults < TOML file < command line. Booleans accept true/false; lists are comma-separated, "
             "or a TOML inline array (\"[{path='/d/a', weight=0.7}, {path='/d/b', weight=0.3}]\").",
             ""]
    for name, cls in SECTIONS.items():
        lines.append((cls.__doc__ or f"[{name}]").strip())
        for key, tname, default, doc in field_docs(cls):
            lines.append(f"  --{name}.{key} ({tname}, default {default!r})")
            lines.append(f"      {doc}")
        lines.append("")
    return "\n".join(lines)


def format_config(cfg: JobConfig) -> str:
    out = []
    for section, values in cfg.to_dict().items():
        out.append(f"[{section}]")
        out.extend(f"  {k} = {v!r}" for k, v in values.items())
    return "\n".join(out)


def main_guard(argv: list[str] | None = None, world_size: int | None = None) -> JobConfig:
    """For entry points: --help prints the field docs; a ConfigError prints one line and exits 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        try:
            print(help_text())
        except BrokenPipeError:  # `--help | head`
            pass
        sys.exit(0)
    try:
        return load_config(argv, world_size)
    except ConfigError as e:
        if global_rank() == 0:
            print(str(e), file=sys.stderr)
        sys.exit(2)


def print_model_summary(cfg) -> dict[str, float]:
    """Builds the model on the meta device (no allocation) and prints what a user checks
    before renting GPUs: the config, the model, its parameter count and FLOPs per token."""
    from parallelisms.apply import build_model

    model = build_model(cfg.model_spec, cfg.model_args)
    summary = cfg.model_spec.summary_fn(model, cfg.model_args, cfg.training.seq_len)
    print(format_config(cfg))
    print(f"model: {model_label(cfg)}")
    print(f"model args: {describe_args(cfg.model_args)}")
    print(f"parameters: {int(summary['params']):,}")
    if "activated_params" in summary:
        print(f"activated parameters: {int(summary['activated_params']):,}")
    print(f"FLOPs/token (seq_len {cfg.training.seq_len}): {summary['flops_per_token']:,.0f}")
    return summary
