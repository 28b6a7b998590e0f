"""`--calibrate`: measures this machine once and stores it as the cpu-gloo hardware entry.

Why measured and not looked up: a CPU's achieved matmul rate at the debug models' shapes,
its attention rate and its gloo bandwidth between processes vary by an order of magnitude
between machines; the CPU validation (scripts/bench_plan.py validate) predicts runs on
this machine, so its peaks must be this machine's. Shapes are the debug models' (tokens
1024, dim 256), fp32, with all cores (the trainer divides them among its ranks).
Everything takes well under a minute.
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.nn.functional as F

from planner.hardware import CPU_NAME, Efficiency, Hardware, default_calibration_file, hardware_toml


def _rate(fn, work: float, min_time: float = 0.6) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_time:
        fn()
        n += 1
    return work * n / (time.perf_counter() - t0)


def measure_matmul() -> float:
    """FLOP/s of the debug models' linear layers (forward shapes), fp32."""
    shapes = [(1024, 256, 256), (1024, 256, 768), (1024, 768, 256), (1024, 256, 2048)]
    rates = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        rates.append(_rate(lambda: a @ b, 2.0 * m * k * n))
    return sum(rates) / len(rates)


def measure_attention() -> float:
    """FLOP/s of causal SDPA forward+backward at the debug shape (4 x 16 heads x 256 x 16)."""
    b, h, s, d = 4, 16, 256, 16
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
    return _rate(step, 3 * 4.0 * b * h * s * s * d * 0.5)


def measure_grouped() -> float:
    """FLOP/s of a batched expert GEMM (8 experts x 384 rows x 256 x 256)."""
    a, w = torch.randn(8, 384, 256), torch.randn(8, 256, 256)
    return _rate(lambda: torch.bmm(a, w), 2.0 * 8 * 384 * 256 * 256)


def measure_memory_bandwidth() -> float:
    """Bytes/s of an elementwise add over 64 MiB tensors (two reads, one write)."""
    a, b = torch.randn(16 << 20), torch.randn(16 << 20)
    out = torch.empty_like(a)
    return _rate(lambda: torch.add(a, b, out=out), 3.0 * a.numel() * 4)


def _debug_llama(ac_mode: str = "none", mesh=None, fsdp: bool = False):
    """(model, cfg): the debug Llama, initialised as the trainer does, with `ac_mode`; TP on the
    1-rank `mesh` (DTensor dispatch with no peer to wait for) and/or FSDP on it."""
    from parallelisms.activation_checkpoint import apply_activation_checkpointing
    from parallelisms.apply import build_model
    from trainer.config import load_config

    cfg = load_config(["--config", "llama_debug.toml", "--activation_checkpoint.mode", ac_mode])
    torch.manual_seed(0)
    model = build_model(cfg.model_spec, cfg.model_args)
    model.to_empty(device="cpu")
    model.init_weights()  # parameters and buffers (the RoPE table), as the trainer's
    if mesh is not None and not fsdp:
        cfg.model_spec.tensor_parallel_fn(model, mesh, cfg.parallelism)
    apply_activation_checkpointing(model, cfg.activation_checkpoint, spec=cfg.model_spec)
    if fsdp:
        from parallelisms.fsdp import apply_fsdp

        apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, backend="gloo")
    return model, cfg


def _block_pass_s(model, cfg, min_time: float = 1.0) -> float:
    """Seconds per block of a forward + backward at 8 tokens: every op's dispatch, little math."""
    tokens = torch.randint(0, cfg.model_args.vocab_size, (1, 8))

    def step():
        model(tokens).float().mean().backward()
    return 1.0 / _rate(step, 1.0, min_time=min_time) / len(model.layers)


_WEIGHTS: dict = {}
WEIGHT_MAX_PARAMS = 100_000_000  # larger models are not instantiated on the CPU (weight 1)


def block_dispatch_weight(cfg) -> float:
    """A block pass of `cfg`'s model (forward + backward at 8 tokens, one thread, per block) as a
    multiple of the calibration's debug Llama block, both measured now, so the load cancels.
    Why: eager dispatch counts ops and their Python, not FLOPs, and blocks differ in both (a
    DeepSeek MoE block routes, sorts and splits: about 3x a Llama block on the debug shapes).
    1 for a model over WEIGHT_MAX_PARAMS, which this CPU would not train (docs/planner.md)."""
    from parallelisms.apply import build_model

    key = (cfg.model_spec.name, repr(cfg.model_args))
    if key not in _WEIGHTS:
        n = sum(p.numel() for p in build_model(cfg.model_spec, cfg.model_args).parameters())  # on meta
        if n > WEIGHT_MAX_PARAMS or key == _calibration_key():  # too big for this CPU, or the calibration's block
            _WEIGHTS[key] = 1.0
        else:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                with torch.random.fork_rng():  # the caller's random state is left as it was
                    torch.manual_seed(0)
                    model = build_model(cfg.model_spec, cfg.model_args)
                    model.to_empty(device="cpu")
                    model.init_weights()
                    reference = _debug_llama()
                    own, ref = [], []
                    for _ in range(3):  # interleaved, fastest of each: a load spike only slows a pass
                        own.append(_block_pass_s(model, cfg, min_time=0.2))
                        ref.append(_block_pass_s(*reference, min_time=0.2))
                    _WEIGHTS[key] = min(own) / min(ref)
            finally:
                torch.set_num_threads(threads)
    return _WEIGHTS[key]


def _calibration_key() -> tuple:
    from trainer.config import load_config

    cfg = load_config(["--config", "llama_debug.toml"])
    return (cfg.model_spec.name, repr(cfg.model_args))


def measure_block_overhead() -> float:
    """Seconds of one block's forward + backward that no token count amortises: the debug
    Llama at 8 tokens, one thread (eager dispatch of every op), per block."""
    return _block_pass_s(*_debug_llama())


def measure_dispatch_multipliers(block_s: float) -> dict[str, float]:
    """What the dispatch of a block pass costs beyond plain eager, one thread, 8 tokens:
    under each AC mode (the policy's own per-op work and the recompute's dispatch) and on
    DTensors (TP), as multiples of `block_s`; and FSDP's hooks (gather copy-in/out, resharding,
    reduce-scatter bookkeeping) in seconds per unit per microbatch. TP and FSDP run on a 1-rank
    gloo mesh here, so no collective waits for a peer (collective_latency_s counts that)."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out = {f"ac_{mode}_dispatch_x": max(1.0, _block_pass_s(*_debug_llama(mode)) / block_s)
           for mode in ("full", "op", "budget")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        out["dtensor_dispatch_x"] = max(1.0, _block_pass_s(*_debug_llama(mesh=mesh)) / block_s)
        model, cfg = _debug_llama(mesh=mesh, fsdp=True)
        units = len(model.layers) + 2  # one FSDP unit per block, the embedding, and the norm + head
        extra = (_block_pass_s(model, cfg) - block_s) * len(model.layers) / units
        out["fsdp_unit_overhead_s"] = max(0.0, extra)
    finally:
        dist.destroy_process_group()
    return out


def _timed(fn, min_time: float) -> float:
    """Seconds per call of a collective `fn`, slowest rank; every rank makes the same number of
    calls (rank 0's count, from one timed call), or the collectives would pair up wrongly."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    fn()
    n = torch.tensor([max(3, int(min_time / max(time.perf_counter() - t0, 1e-6)))])
    dist.broadcast(n, 0)
    t0 = time.perf_counter()
    for _ in range(int(n.item())):
        fn()
    dt = torch.tensor([(time.perf_counter() - t0) / n.item()])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def sync_point_worker(rank: int, world: int, port: int, queue) -> None:
    """`scripts/bench_plan.py syncpoint`: the sync point of a 2-rank gather among `world` processes
    (pairs of ranks, as TP 2 groups), and the pair's latency per call."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    group = pairs[rank // 2]
    tiny = torch.randn(1)
    tiny_out = [torch.empty_like(tiny) for _ in range(2)]
    latency = _timed(lambda: dist.all_gather(tiny_out, tiny, group=group), 0.5)
    sync = _sync_point_s(group)
    if rank == 0:
        queue.put((latency, sync))
    dist.destroy_process_group()


def _gloo_worker(rank: int, world: int, port: int, queue, latency_only: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tiny = torch.randn(1)  # one element: the per-call latency
    tiny_out = [torch.empty_like(tiny) for _ in range(world)]
    small = _timed(lambda: dist.all_gather(tiny_out, tiny), 0.5)
    bandwidth = sync = 0.0
    if not latency_only:
        x = torch.randn(4 << 20)  # 16 MiB
        out = [torch.empty_like(x) for _ in range(world)]
        big = _timed(lambda: dist.all_gather(out, x), 1.0)
        bandwidth = x.numel() * 4 * (world - 1) / max(big - small, 1e-9)  # each rank receives (world-1)/world
        sync = _sync_point_s()
    if rank == 0:
        queue.put((bandwidth, small, sync))
    dist.destroy_process_group()


def _sync_point_s(group=None) -> float:
    """What a blocking collective costs between two steps of work beyond the two apart, as TP's
    gathers sit between its matmuls: (work + gather interleaved) - work - gather, one thread per
    rank, a 256 KiB gather (the debug models' activation at 256 tokens) within `group` (default:
    every rank). Median of 3 repeats."""
    import statistics

    import torch.distributed as dist

    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    x = torch.randn(32 << 10)
    out = torch.empty(x.numel() * dist.get_world_size(group))

    def work():
        for _ in range(8):
            a @ b

    def gather():
        all_gather(out, x, group=group)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of a multi-rank CPU run
    try:
        extra = []
        for _ in range(3):
            alone = _timed(work, 0.2) + _timed(gather, 0.2)
            extra.append(_timed(lambda: (work(), gather()), 0.4) - alone)
    finally:
        torch.set_num_threads(threads)
    return max(0.0, statistics.median(extra))


def measure_gloo(world: int = 2, latency_only: bool = False, worker=None) -> tuple:
    """(bus bandwidth in bytes/s, seconds per call, seconds per sync point) of a gloo all-gather
    between `world` processes (or what `worker(rank, world, port, queue)` puts in the queue)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, queue)) if worker else
             ctx.Process(target=_gloo_worker, args=(r, world, port, queue, latency_only)) for r in range(world)]
    for p in procs:
        p.start()
    bw_latency = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    return bw_latency


def measure_oversubscribed_latency_x(cores: int, latency: float) -> float:
    """How a collective's latency grows with the ranks per core beyond one: the one-element
    all-gather among 2 x and 4 x `cores` processes against `latency` (2 processes), as a factor
    per doubling (geometric mean of the two). 2 (linear) where that would be over 16 processes."""
    if 4 * cores > 16:
        return 2.0
    factors = []
    for doublings, world in ((1, 2 * cores), (2, 4 * cores)):
        slow = measure_gloo(world, latency_only=True)[1]
        factors.append(max(1.0, slow / latency) ** (1 / doublings))
    return max(1.0, math.prod(factors) ** (1 / len(factors)))


def calibrate_cpu(path=None) -> tuple[Hardware, str]:
    """Measures, writes the cpu-gloo TOML to `path` (default: `default_calibration_file()`)
    and returns (the entry, a report)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    t0 = time.perf_counter()
    try:
        mm, attn, grouped, membw = measure_matmul(), measure_attention(), measure_grouped(), measure_memory_bandwidth()
        torch.set_num_threads(1)  # dispatch is one thread's work (multi-rank runs give each rank one)
        block = measure_block_overhead()
        multipliers = measure_dispatch_multipliers(block)
    finally:
        torch.set_num_threads(threads)
    gloo, latency, sync = measure_gloo()
    latency_x = measure_oversubscribed_latency_x(cores, latency)
    with open("/proc/meminfo") as f:
        ram_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    eff = Efficiency(matmul=1.0, float8_matmul=1.0, attention=min(1.0, attn / mm), grouped_gemm=min(1.0, grouped / mm),
                     hbm=1.0, link=1.0, contention_in_node=1.0, contention_inter_node=1.0, compile_elementwise=0.5,
                     step_overhead_s=0.02,
                     block_overhead_s=block, collective_latency_s=latency, sync_point_s=sync,
                     oversubscribed_latency_x=latency_x, **multipliers)
    hw = Hardware(name=CPU_NAME, bf16_tflops=mm / 1e12, fp8_tflops=0.0, hbm_gib=ram_kib / 2**20,
                  hbm_gbs=membw / 1e9, nvlink_gbs=gloo / 1e9, gpus_per_node=64, internode_gbs=gloo / 1e9,
                  device="cpu", cores=cores, efficiency=eff,
                  note=f"measured by scripts/plan.py --calibrate on {cores} cores, fp32")
    out = path or default_calibration_file()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(hardware_toml(hw))
    report = (f"calibrated {CPU_NAME} in {time.perf_counter() - t0:.1f} s on {cores} cores (fp32): matmul "
              f"{mm / 1e9:.1f} GFLOP/s, attention {attn / 1e9:.1f} GFLOP/s ({attn / mm:.0%}), grouped GEMM "
              f"{grouped / 1e9:.1f} GFLOP/s, memory {membw / 1e9:.1f} GB/s, gloo all-gather {gloo / 1e9:.2f} GB/s and "
              f"{latency * 1e6:.0f} us per call ({sync * 1e6:.0f} us more between work; x{latency_x:.1f} per doubling "
              f"of the ranks per core), eager dispatch {block * 1e3:.2f} ms per block pass (x"
              f"{multipliers['ac_full_dispatch_x']:.2f} full AC, x{multipliers['ac_op_dispatch_x']:.2f} op, x"
              f"{multipliers['ac_budget_dispatch_x']:.2f} budget, x{multipliers['dtensor_dispatch_x']:.2f} on DTensors), "
              f"FSDP hooks {multipliers['fsdp_unit_overhead_s'] * 1e3:.2f} ms per unit pass; "
              f"written to {out}")
    return hw, report
