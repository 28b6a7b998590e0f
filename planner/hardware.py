"""The hardware a plan runs on: a small table of known GPUs, a `--hardware FILE` TOML, and
the CPU/gloo entry that `--calibrate` measures on this machine.

Why one table with the calibration next to the peaks: the step-time model
(planner/step_time.py) multiplies peak FLOP/s and bandwidths by a handful of achieved
efficiencies per GPU type. Keeping both in one record means a user's TOML for a new
accelerator states everything the prediction rests on, and nothing is hidden in code.
Every field of a TOML entry is checked here, once; a bad or missing one is one line.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from configuration.fields import ConfigError


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of the peaks (the step-time model's calibration parameters).
    docs/planner.md says where each value comes from."""

    matmul: float = 0.55  # dense bf16 GEMMs (linear layers), of peak FLOP/s
    float8_matmul: float = 0.40  # float8 linear layers (dynamic scaling), of peak fp8 FLOP/s
    attention: float = 0.40  # causal flash attention forward+backward, of peak FLOP/s
    grouped_gemm: float = 0.35  # MoE routed experts' grouped GEMM, of peak FLOP/s
    hbm: float = 0.70  # elementwise ops (norms, activations, adds), of HBM bandwidth
    link: float = 0.75  # collectives, of the link's per-GPU bandwidth (bus bandwidth)
    # Overlapped traffic (FSDP's all-gathers and reduce-scatters, HSDP's all-reduce, PP's sends)
    # hides behind the compute of its phase (forward; backward + recompute) and is exposed beyond
    # it; what it hides still slows the compute by this share of its time (the collective's
    # kernels take SMs and memory bandwidth), per link. 1: nothing hides (a CPU's gloo).
    contention_in_node: float = 0.05
    contention_inter_node: float = 0.05
    # CP all-gather under compile runs flex attention (CUDA): its rate as a share of the fused
    # causal kernel's (`attention`)
    cp_flex_attention: float = 1.0
    compile_elementwise: float = 0.45  # elementwise bytes left after compile's fusion
    step_overhead_s: float = 0.05  # per optimizer step: launch gaps, the optimizer's kernel launches, clip
    # Fixed costs that do not scale with tokens (0 on GPUs: launches run ahead of big kernels, and
    # NCCL latency is not modelled; CPU: measured by --calibrate, where eager dispatch dominates small shapes).
    block_overhead_s: float = 0.0  # per block per microbatch, forward + backward: eager op dispatch
    collective_latency_s: float = 0.0  # per collective call (the alpha of an alpha-beta model)
    # per blocking collective (TP/CP/EP, on the critical path): both ranks wait for the slower one, so
    # their jitter between collectives adds up; CPU: measured as compute + collective interleaved
    sync_point_s: float = 0.0
    # Multiples of block_overhead_s (names end in _x: >= 1, no upper bound): a block pass's dispatch
    # under each AC mode (the policy's per-op work and the recompute's dispatch) and on DTensors (TP).
    ac_full_dispatch_x: float = 1.0
    ac_op_dispatch_x: float = 1.0
    ac_budget_dispatch_x: float = 1.0
    dtensor_dispatch_x: float = 1.0
    fsdp_unit_overhead_s: float = 0.0  # per FSDP unit per microbatch, forward + backward: FSDP2's hooks
    # CPU with more ranks than cores: a collective's latency (and sync point) grows by this factor
    # each time the ranks per core double (every hop waits for a rank to be scheduled); 2 = linear
    oversubscribed_latency_x: float = 2.0


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_tflops: float  # peak dense bf16 (fp32 on CPU)
    fp8_tflops: float  # peak dense fp8; 0 = no fp8
    hbm_gib: float  # memory per device
    hbm_gbs: float  # memory bandwidth, GB/s
    nvlink_gbs: float  # per-GPU bandwidth inside a node (one direction), GB/s
    gpus_per_node: int
    internode_gbs: float  # per-GPU bandwidth between nodes, GB/s
    device: str = "cuda"  # "cuda" or "cpu": where the trainer runs (the estimator's device)
    cores: int = 0  # cpu only: cores the ranks of one node share (0: no sharing)
    efficiency: Efficiency = field(default_factory=Efficiency)
    note: str = ""

    def describe(self) -> str:
        return (f"{self.name}: {self.bf16_tflops:g} TFLOP/s bf16, {self.fp8_tflops:g} fp8, {self.hbm_gib:g} GiB at "
                f"{self.hbm_gbs:g} GB/s, {self.nvlink_gbs:g} GB/s in a node of {self.gpus_per_node}, "
                f"{self.internode_gbs:g} GB/s between nodes")


# The efficiencies calibrated on TorchTitan's published H100 rows (docs/planner.md, "Calibration");
# every GPU below shares them until it has rows of its own.
# Fitted on the four calibration rows and nothing else (`python scripts/bench_plan.py fit`): matmul,
# hbm and step_overhead_s (the three 8-GPU rows), contention_inter_node (the 128-GPU row; in-node set
# equal to it). Derived, not
# fitted to any run: attention = 0.68 x matmul (FlashAttention-2's causal fwd+bwd relative to GEMMs
# on H100); float8_matmul from torchao's microbenchmark of one compiled Linear (`fit` prints it).
# Set (priors; docs/planner.md): grouped_gemm, link, compile_elementwise, cp_flex_attention.
H100_EFFICIENCY = Efficiency(matmul=0.592, float8_matmul=0.613, attention=0.403, grouped_gemm=0.35, hbm=0.241,
                             link=0.70, contention_in_node=0.070, contention_inter_node=0.070, cp_flex_attention=0.87,
                             compile_elementwise=0.5, step_overhead_s=0.144)

KNOWN: dict[str, Hardware] = {h.name: h for h in (
    Hardware("h100-sxm", 989, 1979, 79.6, 3350, 450, 8, 50, efficiency=H100_EFFICIENCY,
             note="H100 SXM5 80 GB, NVLink 4 (900 GB/s bidirectional), 400 Gb/s NIC per GPU"),
    # Their write-up: "the actual peak TFLOPs number is between SXM and NVL": the midpoint of the SXM
    # (989 / 1979 dense bf16 / fp8) and NVL (835 / 1671) datasheet peaks.
    Hardware("h100-tt", 912, 1825, 89.4, 2400, 450, 8, 50, efficiency=H100_EFFICIENCY,
             note="TorchTitan's benchmark H100: SXM at 500 W (peak between SXM and NVL: the midpoint), 96 GB HBM2e "
                  "at 2.4 TB/s, 400 Gb/s per GPU"),
    Hardware("h100-pcie", 756, 1513, 79.6, 2000, 64, 8, 50, efficiency=H100_EFFICIENCY,
             note="H100 PCIe 80 GB without NVLink bridges: peers talk over PCIe 5 (assumed 64 GB/s)"),
    Hardware("h200", 989, 1979, 139.8, 4800, 450, 8, 50, efficiency=H100_EFFICIENCY,
             note="H200 SXM 141 GB HBM3e, NVLink 4, 400 Gb/s per GPU"),
    Hardware("b200", 2250, 4500, 178.8, 8000, 900, 8, 100, efficiency=H100_EFFICIENCY,
             note="B200 180 GB, NVLink 5, 800 Gb/s per GPU; H100 efficiencies (uncalibrated)"),
    Hardware("gb200", 2500, 5000, 184.0, 8000, 900, 72, 100, efficiency=H100_EFFICIENCY,
             note="GB200 NVL72: 72 GPUs in one NVLink domain; H100 efficiencies (uncalibrated)"),
    Hardware("a100", 312, 0, 79.2, 2039, 300, 8, 25, efficiency=H100_EFFICIENCY,
             note="A100 SXM 80 GB, NVLink 3, 200 Gb/s per GPU; no fp8"),
    Hardware("mi300x", 1307, 2615, 191.5, 5300, 448, 8, 50, efficiency=H100_EFFICIENCY,
             note="MI300X 192 GB, Infinity Fabric 7 x 64 GB/s; H100 efficiencies (uncalibrated, RCCL)"),
)}

CPU_NAME = "cpu-gloo"
_FIELDS = [f for f in dataclasses.fields(Hardware) if f.name not in ("name", "efficiency", "note", "device", "cores")]
_EFF_FIELDS = [f.name for f in dataclasses.fields(Efficiency)]


def default_calibration_file() -> Path:
    """Where `--calibrate` stores the cpu-gloo entry (TITAN_PLANNER_CALIBRATION overrides)."""
    from configuration.environment import env_value

    env = env_value("TITAN_PLANNER_CALIBRATION")
    return Path(env) if env else Path.home() / ".cache" / "titanlite" / "cpu-gloo.toml"


def known_names() -> str:
    return ", ".join([*KNOWN, CPU_NAME])


def _number(source: str, key: str, value, *, positive: bool = True, at_most: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config error: {source}: {key} = {value!r} is not a number; give a number")
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"config error: {source}: {key} = {value!r} must be {'> 0' if positive else '>= 0'}")
    if at_most is not None and value > at_most:
        raise ConfigError(f"config error: {source}: {key} = {value!r} is above {at_most:g}")
    return value


def hardware_from_table(table: dict, source: str, name: str | None = None) -> Hardware:
    """A `Hardware` from a TOML table: every peak field required, [efficiency] optional
    (defaults: the H100 calibration), unknown keys refused."""
    allowed = {f.name for f in _FIELDS} | {"name", "efficiency", "note", "device", "cores"}
    for key in table:
        if key not in allowed:
            raise ConfigError(f"config error: {source}: unknown field {key!r}; fields: {', '.join(sorted(allowed))}")
    values = {}
    for f in _FIELDS:
        if f.name not in table:
            raise ConfigError(f"config error: {source}: missing field {f.name} ({_DOCS[f.name]}); add it")
        positive = f.name not in ("fp8_tflops",)
        v = _number(source, f.name, table[f.name], positive=positive)
        if f.name == "gpus_per_node":
            if v != int(v):
                raise ConfigError(f"config error: {source}: gpus_per_node = {v!r} must be a whole number")
            v = int(v)
        values[f.name] = v
    device = table.get("device", "cuda")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"config error: {source}: device = {device!r} is not one of cuda, cpu")
    cores = int(_number(source, "cores", table.get("cores", 0), positive=False))
    eff_table = table.get("efficiency", {})
    if not isinstance(eff_table, dict):
        raise ConfigError(f"config error: {source}: [efficiency] must be a table of key = value")
    eff = {}
    if "overlap" in eff_table:  # calibration files before the per-link terms: the share hidden
        hidden = eff_table["overlap"]
        eff_table = {k: v for k, v in eff_table.items() if k != "overlap"}
        if isinstance(hidden, (int, float)) and not isinstance(hidden, bool):
            eff_table |= {"contention_in_node": 1 - hidden, "contention_inter_node": 1 - hidden}
    for key, v in eff_table.items():
        if key not in _EFF_FIELDS:
            raise ConfigError(f"config error: {source}: unknown efficiency field {key!r}; fields: "
                              f"{', '.join(_EFF_FIELDS)}")
        seconds, multiple = key.endswith("_s"), key.endswith("_x")
        eff[key] = _number(source, f"efficiency.{key}", v, positive=not seconds and not key.startswith("contention"),
                           at_most=None if seconds or multiple else 1.0)
        if multiple and v < 1:
            raise ConfigError(f"config error: {source}: efficiency.{key} = {v!r} is a multiple (a factor of a "
                              "measured cost); give a number >= 1")
    base = H100_EFFICIENCY if device == "cuda" else Efficiency()
    return Hardware(name=str(table.get("name", name or Path(source).stem)), device=device, cores=cores,
                    efficiency=dataclasses.replace(base, **eff), note=str(table.get("note", "")), **values)


_DOCS = {"bf16_tflops": "peak dense bf16 TFLOP/s", "fp8_tflops": "peak dense fp8 TFLOP/s, 0 if none",
         "hbm_gib": "memory per GPU, GiB", "hbm_gbs": "memory bandwidth, GB/s",
         "nvlink_gbs": "per-GPU bandwidth inside a node, GB/s", "gpus_per_node": "GPUs per node",
         "internode_gbs": "per-GPU bandwidth between nodes, GB/s"}


def load_hardware_file(path: str) -> Hardware:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config error: --hardware: {path} not found; pass a TOML file (see docs/planner.md)")
    try:
        table = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config error: --hardware: {path} is not valid TOML: {e}") from None
    return hardware_from_table(table, str(path))


def get_hardware(name: str | None = None, path: str | None = None, calibration: Path | None = None) -> Hardware:
    """The `--gpu NAME` entry, or the `--hardware FILE` one; cpu-gloo from the calibration file."""
    if path:
        return load_hardware_file(path)
    name = (name or "h100-sxm").lower()
    if name in KNOWN:
        return KNOWN[name]
    if name == CPU_NAME:
        cal = calibration or default_calibration_file()
        if not cal.is_file():
            raise ConfigError(f"config error: --gpu: {CPU_NAME} is measured on this machine, and {cal} does not "
                              "exist yet; run python scripts/plan.py --calibrate first")
        return load_hardware_file(str(cal))
    raise ConfigError(f"config error: --gpu: unknown GPU {name!r}; known: {known_names()} (or --hardware FILE)")


def hardware_toml(hw: Hardware) -> str:
    """The TOML of an entry (what `--calibrate` stores; `load_hardware_file` reads it back)."""
    lines = [f'name = "{hw.name}"', f'device = "{hw.device}"', f"cores = {hw.cores}", f'note = "{hw.note}"']
    lines += [f"{f.name} = {getattr(hw, f.name)!r}" for f in _FIELDS]
    lines += ["", "[efficiency]"] + [f"{k} = {getattr(hw.efficiency, k)!r}" for k in _EFF_FIELDS]
    return "\n".join(lines) + "\n"
