"""Float8 training through torchao: `[float8]` converts Linear layers to `Float8Linear`.

Why torchao and not our own `_scaled_mm` wrapper: torchao's `Float8Linear` already does
dynamic tensorwise and rowwise scaling in all three GEMMs of a linear (output, grad_input,
grad_weight), the FSDP2 float8 all-gather (weights cast to float8 *before* the
all-gather, halving its bytes), and DTensor/compile support. torch 2.13's
`torch._scaled_mm` has a CPU kernel, so the very same code path runs on CPU, and the
numerics are tested there (tests/test_float8.py). Speed only exists on GPUs with
float8 tensor cores (compute capability >= 8.9: H100, H200, L40S, RTX 4090) and with
torch.compile, which fuses the amax/scale/cast kernels around each GEMM.

Where it runs in the assembly: on each model part, after the PP split and before TP,
AC, compile and FSDP (as TorchTitan does): TP then shards `Float8Linear` modules like
any Linear, and FSDP sees the float8-aware weight subclass when the float8 all-gather
is on. Parameter names and state-dict keys do not change (`Float8Linear` is an
`nn.Linear` with the same `weight`); checkpoints are interchangeable with bf16 runs.

Not converted: the output head (the logits feed the loss, and its vocab dimension is
the one most sensitive to float8 rounding) and the MoE router gate (routing decisions
flip on small errors; it is computed in fp32 anyway), both through the default
`filter_fqns`; any Linear whose dims are not multiples of 16 (a `_scaled_mm`
requirement); subclasses of nn.Linear such as the chunked-CE head.

MoE routed experts (`moe_grouped_gemm`, CUDA only): the experts' grouped GEMMs go
through torchao's prototype float8 rowwise grouped GEMM (Triton kernels, SM90+), with
each expert's rows padded to 16 (`GroupedExperts.float8_grouped_mm`). Prepared, not yet
run on a GPU; see docs/performance.md.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from configuration.fields import ConfigError, opt

logger = logging.getLogger("float8")

TORCHAO_HINT = "pip install -e '.[float8]' (torchao>=0.18.0)"
# torch._scaled_mm needs both dims of each operand to be multiples of 16.
FLOAT8_DIM_MULTIPLE = 16
# Float8 tensor cores: Ada (8.9) and Hopper (9.0) and later.
MIN_CAPABILITY = (8, 9)


@dataclass
class Float8Config:
    """[float8]: float8 training of Linear layers (torchao)."""

    enable: bool = opt(False, "Convert Linear layers to torchao Float8Linear (dynamic scaling). Needs torchao; on "
                       "CUDA a GPU with compute capability >= 8.9.")
    recipe: str = opt("tensorwise", "Scaling granularity: tensorwise (one scale per tensor, fastest) or rowwise "
                      "(one scale per row, power-of-2 scales, more accurate).", choices=("tensorwise", "rowwise"))
    filter_fqns: list[str] = opt(["output", "router.gate"], "Linear layers left in high precision: a module name "
                                 "matches if it equals an entry, ends with '.' + entry, or fnmatches it.")
    enable_fsdp_float8_all_gather: bool = opt(False, "Cast weights to float8 before FSDP's all-gather (half the "
                                              "bytes of bf16). tensorwise only.")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(True, "With the float8 all-gather: compute every weight's "
                                                         "scale in one all-reduce after the optimizer step, instead "
                                                         "of one per weight in the next forward.")
    moe_grouped_gemm: bool = opt(False, "Also run the MoE routed experts' grouped GEMMs in float8 (rowwise, "
                                 "torchao prototype; CUDA SM90+ only).")

    def validate(self, root) -> None:
        if not self.enable:
            if self.moe_grouped_gemm or self.enable_fsdp_float8_all_gather:
                raise ConfigError("config error: float8.enable: false, but float8.moe_grouped_gemm / "
                                  "enable_fsdp_float8_all_gather are set; set --float8.enable true or unset them")
            return
        require_torchao()
        from parallelisms.expert_parallel import routed_experts

        if self.moe_grouped_gemm and not routed_experts(root.model_args):
            raise ConfigError("config error: float8.moe_grouped_gemm: the model has no routed experts (nothing to "
                              "convert); set --float8.moe_grouped_gemm false")
        if self.moe_grouped_gemm and root.optimizer.name == "muon":
            raise ConfigError("config error: float8.moe_grouped_gemm: stores the experts transposed for the kernel, "
                              "and Muon's update scale reads them as [E, in, out]; use optimizer.name AdamW or set "
                              "--float8.moe_grouped_gemm false")
        if self.enable_fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ConfigError(f"config error: float8.enable_fsdp_float8_all_gather: needs recipe tensorwise (got "
                              f"{self.recipe!r}); set --float8.recipe tensorwise or turn the float8 all-gather off")


def require_torchao():
    """Imports torchao.float8 (quietly: on a CPU-only build torchao logs a warning for each
    CUDA extension it cannot load) or raises a one-line ConfigError."""
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ConfigError(f"config error: float8.enable: torchao is not installed ({e}); {TORCHAO_HINT}") from None
    finally:
        quiet.setLevel(level)
    return float8


def check_device(device: torch.device) -> None:
    """Float8 GEMMs need float8 tensor cores on CUDA; CPU runs them (slowly) in torch's kernel."""
    if device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise ConfigError(f"config error: float8.enable: {torch.cuda.get_device_name(device)} has compute "
                          f"capability {cap[0]}.{cap[1]}; float8 needs >= 8.9 (H100, L40S, RTX 4090); "
                          "set --float8.enable false")


def use_torch_cpu_float8_kernel() -> None:
    """Routes CPU float8 matmuls to torch's own dequantize-and-matmul kernel, for the process.

    On a CPU with AMX-INT8, torch sends `_scaled_mm` to oneDNN, whose float8 matmul there is
    its reference kernel: 0.54 s for one 256 x 256 x 256 product against 1.5 ms without oneDNN
    (one thread, Xeon with AMX). The first step of the golden float8 case took minutes. Off,
    every CPU takes the same path, so float8 runs also repeat across CPU models. fp32 matmuls
    on CPU use BLAS, not oneDNN, so nothing else a CPU run does changes."""
    torch.backends.mkldnn.enabled = False


def float8_filter(cfg: Float8Config) -> list[str] | None:
    """What the layout checks need of float8: its filter_fqns when it is on, else None."""
    return cfg.filter_fqns if cfg.enable else None


def name_matches(fqn: str, patterns) -> bool:
    return any(fqn == p or fqn.endswith("." + p) or fnmatch.fnmatch(fqn, p) for p in patterns)


def float8_linear_filter(cfg: Float8Config):
    """`module_filter_fn(module, fqn)` for torchao: plain nn.Linear, not filtered by name,
    dims multiples of 16."""

    def keep(module: nn.Module, fqn: str) -> bool:
        if type(module) is not nn.Linear or name_matches(fqn, cfg.filter_fqns):
            return False
        out_f, in_f = module.weight.shape
        if out_f % FLOAT8_DIM_MULTIPLE or in_f % FLOAT8_DIM_MULTIPLE:
            logger.info("float8: %s stays high precision (%d x %d: not multiples of %d)", fqn, out_f, in_f,
                        FLOAT8_DIM_MULTIPLE)
            return False
        return True

    return keep


def torchao_linear_config(cfg: Float8Config):
    float8 = require_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(cfg.recipe)
    if cfg.enable_fsdp_float8_all_gather:
        import dataclasses

        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def apply_float8(model: nn.Module, cfg: Float8Config, device: torch.device | None = None) -> list[str]:
    """Converts `model` (one model part, possibly on the meta device) in place.
    Returns the names of the converted Linear layers (and routed-expert modules)."""
    if not cfg.enable:
        return []
    if device is not None:
        check_device(device)
        if device.type == "cpu":
            use_torch_cpu_float8_kernel()
    float8 = require_torchao()
    keep = float8_linear_filter(cfg)
    converted = [name for name, m in model.named_modules() if keep(m, name)]
    float8.convert_to_float8_training(model, config=torchao_linear_config(cfg), module_filter_fn=keep)
    if cfg.moe_grouped_gemm:
        converted += enable_float8_grouped_experts(model, device)
    logger.info("float8 (%s): %d modules converted", cfg.recipe, len(converted))
    return converted


def enable_float8_grouped_experts(model: nn.Module, device: torch.device | None) -> list[str]:
    """Marks every routed-experts module to run its grouped GEMMs through torchao's float8
    rowwise grouped GEMM (see `GroupedExperts`)."""
    from models.common.moe import GroupedExperts

    if device is not None and device.type != "cuda":
        raise ConfigError("config error: float8.moe_grouped_gemm: torchao's float8 grouped GEMM has CUDA (SM90+) "
                          "kernels only; set --float8.moe_grouped_gemm false on this device")
    if device is not None and torch.cuda.get_device_capability(device) < (9, 0):
        raise ConfigError("config error: float8.moe_grouped_gemm: needs compute capability >= 9.0 (H100); "
                          "set --float8.moe_grouped_gemm false")
    names = []
    for name, m in model.named_modules():
        if isinstance(m, GroupedExperts):
            m.float8_grouped_mm = True
            m.store_for_kernel()  # the layout the kernel reads: no per-call copy of the weights
            names.append(name)
    return names


def precompute_float8_scales(model_parts, cfg: Float8Config) -> None:
    """After the optimizer step: one all-reduce computes the next forward's weight scales
    (only with the FSDP float8 all-gather, where each weight's shard is cast before the gather)."""
    if not (cfg.enable and cfg.enable_fsdp_float8_all_gather and cfg.precompute_float8_dynamic_scale_for_fsdp):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in model_parts:
        precompute_float8_dynamic_scale_for_fsdp(part)


def reduce_scales_over(model: nn.Module, mesh, cfg: Float8Config) -> int:
    """Under CP each rank holds a slice of every sequence. Each Float8Linear's input and output
    gradient then take their tensorwise scale from the amax over `mesh` (a max all-reduce of one
    scalar per cast), i.e. over the whole sequences, as one rank does. With per-rank scales the CP
    ranks round differently from one rank: measured (tests/test_feature_matrix.py), after 3 steps
    as far from one rank's float8 as float8 is from fp32. The weights are whole on every CP rank
    (FSDP gathers them), so their scales already agree. Rowwise scales are per row (token) in the
    forward and are left alone. Returns the number of linears."""
    if cfg.recipe != "tensorwise":
        return 0
    from torchao.float8.float8_linear import Float8Linear

    linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
    for m in linears:
        m.register_forward_pre_hook(_cast_input_over(mesh))
        m.register_forward_hook(_cast_grad_output_over(mesh))
    return len(linears)


def _cast(x: torch.Tensor, module: nn.Module, mesh, role) -> torch.Tensor:
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    c = module.config
    dtype = c.cast_config_input.target_dtype if role is GemmInputRole.INPUT else c.cast_config_grad_output.target_dtype
    return hp_tensor_to_float8_dynamic(x, dtype, module.linear_mm_config, reduce_amax=True, gemm_input_role=role,
                                       device_mesh=mesh, round_scales_to_power_of_2=c.round_scales_to_power_of_2)


def _cast_input_over(mesh):
    """Forward pre-hook: the input cast before the linear (torchao's matmul takes a cast input as
    is, for its forward and for the weight gradient, as in its float8 TP plans)."""
    from torchao.float8.float8_training_tensor import GemmInputRole

    def hook(module, args):
        return (_cast(args[0], module, mesh, GemmInputRole.INPUT), *args[1:])

    return hook


def _cast_grad_output_over(mesh):
    """Forward hook: the output, whose gradient is cast before the linear's backward reads it."""

    def hook(module, args, output):
        return _CastGradOver.apply(output, module, mesh)

    return hook


class _CastGradOver(torch.autograd.Function):
    """Forward: nothing. Backward: the gradient cast to float8 with its amax over `mesh`."""

    @staticmethod
    def forward(ctx, y, module, mesh):
        ctx.module, ctx.mesh = module, mesh
        return y

    @staticmethod
    def backward(ctx, grad):
        from torchao.float8.float8_training_tensor import GemmInputRole

        return _cast(grad, ctx.module, ctx.mesh, GemmInputRole.GRAD_OUTPUT), None, None
