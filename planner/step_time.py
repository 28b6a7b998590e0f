"""Predicted time of one optimizer step of a plan: compute, communication, bubble, recompute.

Why this shape: a training engineer sizing a cluster needs to know not only how fast a
layout is but why, so each term is a named part (`--explain N` prints them) built from
quantities that can be checked one by one:

- FLOPs per op class (dense matmul, attention, grouped GEMM) from the built model
  (planner/workload.py), at an achieved efficiency per class and GPU;
- elementwise work (norms, SwiGLU, RoPE, residual adds, the loss, float8 casts) as bytes
  over HBM bandwidth; compile fuses part of it away;
- every collective the plan issues, with its bytes per rank, over the link its group
  crosses (mesh order pp, dp_replicate, dp_shard, cp, tp: a group stays in a node when
  its span fits), and whether it overlaps compute: FSDP, HSDP and PP traffic hides behind
  the compute of its own phase (forward or backward) on its own link, at a contention cost
  (`exposed_overlapped`); TP, CP and EP traffic sits on the critical path;
- the schedule's pipeline bubble, and the recompute of the chosen AC mode.

The calibration parameters are `hardware.Efficiency`, all in docs/planner.md with where
they come from. Nothing else is fitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.hardware import Hardware
from planner.layout import Plan
from planner.workload import Workload

# Forward recompute under each AC mode, as a share of the blocks' forward (matmul, attention)
# and of their forward elementwise traffic. full: the whole forward (early stop ignored);
# op: every other matmul, attention kept, all elementwise; budget f: (1-f)^2 of the FLOPs
# (the budget keeps the outputs that save the most FLOPs per byte first), (1-f) of the rest.
def recompute_shares(plan: Plan) -> tuple[float, float, float]:
    """(matmul share, attention share, elementwise share) of a forward recomputed."""
    if plan.ac == "full":
        return 1.0, 1.0, 1.0
    if plan.ac == "op":
        return 0.5, 0.0, 1.0
    if plan.ac == "budget":
        f = plan.budget_fraction
        return (1 - f) ** 2, (1 - f) ** 2, 1 - f
    return 0.0, 0.0, 0.0


def bubble_fraction(plan: Plan) -> float:
    """Idle share of a PP rank relative to its work, per schedule (n microbatches, v stages per rank)."""
    if plan.pp == 1:
        return 0.0
    p, n, v = plan.pp, plan.n_microbatches, plan.stages_per_rank
    return {"GPipe": (p - 1) / n, "1F1B": (p - 1) / n, "Interleaved1F1B": (p - 1) / (n * v),
            "LoopedBFS": (p - 1) / (n * v), "InterleavedZeroBubble": (p - 1) / (3 * n * v),
            "ZBVZeroBubble": (p - 1) / (3 * n * v), "DualPipeV": (p - 1) / (2 * n * v)}[plan.schedule]


@dataclass
class Collective:
    name: str
    bytes: float  # per rank per step, on the wire (ring: (g-1)/g of the tensor)
    group: int
    link: str  # "in-node" or "inter-node"
    seconds: float  # bytes over the link, plus calls x the per-call latency
    overlapped: bool
    calls: float = 0.0  # per rank per step
    kind: str = ""  # all_gather | reduce_scatter | all_reduce | all_to_all | send_recv
    phase: str = ""  # overlapped ones: the compute they hide behind (forward, backward; end: none)


@dataclass
class StepTime:
    plan: Plan
    parts: dict  # name -> seconds (sum = step)
    collectives: list = field(default_factory=list)
    tokens_per_step: int = 0
    flops_per_token: float = 0.0
    peak_flops: float = 0.0

    @property
    def step_s(self) -> float:
        return sum(self.parts.values())

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_s / self.plan.world

    @property
    def mfu(self) -> float:
        return self.flops_per_token * self.tokens_per_s_per_gpu / self.peak_flops

    @property
    def bottleneck(self) -> str:
        groups = {"compute": self.parts["matmul"] + self.parts["attention"] + self.parts["grouped GEMM"]
                  + self.parts["elementwise"],
                  "exposed comm": self.parts["exposed comm (TP/CP/EP)"] + self.parts["exposed comm (FSDP/HSDP/PP)"],
                  "bubble": self.parts["pipeline bubble"], "recompute": self.parts["recompute"],
                  "optimizer+overhead": self.parts["optimizer step"] + self.parts["fixed overhead"]
                  + self.parts["eager dispatch"]}
        if groups["compute"] >= 0.6 * self.step_s:
            return "compute"
        return max((k for k in groups if k != "compute"), key=groups.get)


def busiest_pp_rank(plan: Plan, w: Workload) -> tuple[list[int], bool, bool]:
    """The blocks of the PP rank with the most matmul work, and whether it holds the embedding
    and the head (with the final norm): the trainer's own split (parallelisms/pipeline.py: stages
    balanced with the embedding and the head weighing a block each; a rank's stages looped, or
    V-shaped for the V schedules)."""
    if plan.pp == 1:
        return list(range(w.n_layers)), True, True
    from parallelisms.parallel_dims import V_SCHEDULES
    from parallelisms.pipeline import stage_block_counts, stage_ids_for_rank

    stages = plan.pp * plan.stages_per_rank
    counts = stage_block_counts(w.n_layers, stages)
    starts = [sum(counts[:s]) for s in range(stages)]
    best = (-1.0, [], False, False)
    for rank in range(plan.pp):
        ids = stage_ids_for_rank(rank, plan.pp, plan.stages_per_rank, plan.schedule in V_SCHEDULES)
        blocks = [i for s in ids for i in range(starts[s], starts[s] + counts[s])]
        head = stages - 1 in ids
        work = sum(w.layer_dense[i] + w.layer_active_experts[i] for i in blocks) + (w.head if head else 0)
        if work > best[0]:
            best = (work, blocks, 0 in ids, head)
    return best[1:]


def exposed_overlapped(colls: list, plan: Plan, hw: Hardware, compute: float, recompute: float) -> float:
    """What the overlapped traffic costs the step. Per phase and link, the traffic a phase issues
    hides behind that phase's compute (forward: a third of it; backward: the rest and the
    recompute; under PP the once-per-step gather has only the first microbatch's forward) and is
    exposed beyond it; what hides still slows the compute by `contention_<link>` of its time. The
    first unit's gather of each forward is exposed (nothing runs before it), and so is a
    reduction after the last microbatch ("end"). Phases: forward, "first forward" (the first
    microbatch's: PP's once-per-step gathers), backward, end."""
    eff = hw.efficiency
    window = {"forward": compute / 3, "first forward": compute / 3 / plan.n_microbatches,
              "backward": compute * 2 / 3 + recompute, "end": 0.0}
    traffic: dict = {}
    for c in colls:
        if c.overlapped:
            traffic[c.phase, c.link] = traffic.get((c.phase, c.link), 0.0) + c.seconds
    exposed = 0.0
    for (phase, link), seconds in traffic.items():
        contention = eff.contention_in_node if link == "in-node" else eff.contention_inter_node
        hidden = min(seconds, window[phase])
        exposed += seconds - hidden + contention * hidden
    first = next((c for c in colls if c.name.startswith("FSDP all-gather (") and "forward" in c.phase), None)
    if first is not None and first.calls:  # one unit per forward waits for its own gather
        exposed += first.seconds / first.calls * (1 if plan.pp > 1 else plan.n_microbatches)
    return exposed


def float8_linear_speedup(hw: Hardware, m: int, k: int, n: int) -> float:
    """The model's speedup of one compiled Linear (tokens m, in k, out n), forward + backward, in
    tensorwise float8 over bf16: its three GEMMs at `float8_matmul` of the fp8 peak, plus the casts
    `predict` charges (input 10 bytes, output gradient 7, weight 2 x 5 per element) at compile's
    share of the elementwise traffic. H100's `float8_matmul` is set so that this gives torchao's
    microbenchmark (docs/planner.md)."""
    eff = hw.efficiency
    flops = 6.0 * m * k * n
    bf16 = flops / (hw.bf16_tflops * 1e12 * eff.matmul)
    casts = (10 * m * k + 7 * m * n + 10 * k * n) * eff.compile_elementwise / (hw.hbm_gbs * 1e9 * eff.hbm)
    return bf16 / (flops / (hw.fp8_tflops * 1e12 * eff.float8_matmul) + casts)


def _link(span: int, hw: Hardware) -> tuple[str, float]:
    if span <= hw.gpus_per_node:
        return "in-node", hw.nvlink_gbs * 1e9
    return "inter-node", hw.internode_gbs * 1e9


def predict(plan: Plan, w: Workload, hw: Hardware, seq_len: int, *, compute_bytes: int = 2) -> StepTime:
    """The predicted step of `plan` for workload `w` at `seq_len` on `hw`. `compute_bytes`:
    the activation / gathered-parameter element size (2 for bf16 on GPUs, 4 for fp32 on CPU)."""
    eff = hw.efficiency
    esize = compute_bytes
    peak = hw.bf16_tflops * 1e12
    if hw.device == "cpu" and hw.cores:  # the ranks of a node share its cores (OMP threads = cores / ranks)
        peak *= 1.0 / min(plan.world, hw.gpus_per_node)
    hbm = hw.hbm_gbs * 1e9 * eff.hbm
    if hw.device == "cpu" and hw.cores:
        hbm *= 1.0 / min(plan.world, hw.gpus_per_node)
    tp, cp, pp, ep = plan.tp, plan.cp, plan.pp, plan.ep
    shard = cp * tp  # ranks that split one microbatch's work
    n_mb = plan.n_microbatches
    tokens_mb = plan.samples_per_microbatch * seq_len  # one microbatch of one data-parallel rank
    tok = n_mb * tokens_mb / shard  # this rank's share of the tokens it processes per step
    layers, holds_embedding, holds_head = busiest_pp_rank(plan, w)
    L = len(layers)

    head_mm = w.head if holds_head else 0
    fp8_ok = plan.float8 and hw.fp8_tflops > 0
    # float8 converts every block Linear but the router gate (not the head, not routed experts)
    f8_weights = sum(w.layer_float8[i] for i in layers) if fp8_ok and w.layer_float8 else 0
    # MLA under CP all-gather: every rank up-projects the whole gathered latent (wkv_b on S, not S/cp)
    allgather_cp = cp > 1 and plan.cp_method == "allgather"
    kv_up = (cp - 1) * sum(w.layer_kv_up[i] for i in layers) if allgather_cp and w.layer_kv_up else 0
    bf16_mm = tok * (w.matmul_flops_per_token(layers) - 6.0 * f8_weights + 6.0 * kv_up)
    fp8_peak = hw.fp8_tflops * 1e12 * (peak / (hw.bf16_tflops * 1e12))
    head_s = tok * 6.0 * head_mm / (peak * eff.matmul)
    t_mm = bf16_mm / (peak * eff.matmul) + head_s
    if f8_weights:
        t_mm += tok * 6.0 * f8_weights / (fp8_peak * eff.float8_matmul)
    # CP all-gather under compile on CUDA runs flex attention on its query chunks (context_parallel.py)
    attn_rate = eff.attention * (eff.cp_flex_attention if allgather_cp and plan.compile and hw.device == "cuda" else 1.0)
    t_attn = tok * w.attention_flops_per_token(layers, seq_len) / (peak * attn_rate)
    t_grouped = tok * w.grouped_flops_per_token(layers) / (peak * eff.grouped_gemm)

    # elementwise bytes per token per block, forward: 2 norms (r+w), 2 residual adds (2r+w),
    # RoPE on q and k (r+w), SwiGLU (2r+w of the hidden); backward about twice that.
    fwd_ew = esize * (4 * w.dim + 6 * w.dim + 2 * w.qkvo_width // 2 + 3 * w.ffn_hidden)
    ew_bytes = tok * L * 3 * fwd_ew
    loss_shards = tp if tp > 1 else 1
    ew_bytes += holds_head * n_mb * tokens_mb / cp * w.vocab * 4 * 6 / loss_shards  # fp32 logits: softmax fwd+bwd
    if fp8_ok:  # tensorwise dynamic scaling (torchao), per float8 Linear and microbatch:
        # its input: amax (read 2) + cast (read 2, write 1) forward and again for grad_weight;
        # its output gradient: the same once, plus the transposed copy (read 1, write 1);
        f_in = sum(w.layer_float8_io[i][0] for i in layers)
        f_out = sum(w.layer_float8_io[i][1] for i in layers)
        ew_bytes += tok * (10 * f_in + 7 * f_out)
        # its weight: cast forward and backward, or (float8 all-gather) its local shard, once per gather
        shards = 1 if not plan.float8_all_gather else plan.dp_shard * cp
        ew_bytes += n_mb * 2 * 5 * f8_weights / tp / shards
    ew_scale = eff.compile_elementwise if plan.compile else 1.0
    t_ew = ew_bytes * ew_scale / hbm

    # Eager dispatch: a fixed cost per block pass that no token count amortises (CPU: measured;
    # its ranks share the cores, so it stretches when there are more ranks than cores).
    # The AC and DTensor multiples are measured (--calibrate) and hold the recompute's dispatch
    # and the policy's own per-op work; FSDP's hooks run once per unit per microbatch.
    oversubscribed = max(1.0, plan.world / hw.cores) if hw.device == "cpu" and hw.cores else 1.0
    # per collective call: measured to grow faster than the ranks per core (--calibrate)
    latency_stretch = oversubscribed ** math.log2(eff.oversubscribed_latency_x)
    # A sync point is a core left idle while its rank waits for a peer: with more ranks than
    # cores another rank runs in the wait (measured: `python scripts/bench_plan.py syncpoint`).
    sync_point = eff.sync_point_s if oversubscribed == 1.0 else 0.0
    ac_x = {"full": eff.ac_full_dispatch_x, "op": eff.ac_op_dispatch_x, "budget": eff.ac_budget_dispatch_x}
    dispatch_x = ac_x.get(plan.ac, 1.0) * (eff.dtensor_dispatch_x if tp > 1 else 1.0) * w.block_dispatch_weight
    fsdp = plan.dp_shard * cp
    sharded = plan.dp_shard * cp * plan.dp_replicate > 1
    # FSDP units (parallelisms/fsdp.py): the embedding, each block, and the final norm + head
    # (a tied head shares the embedding's), where the rank holds them
    end_units = 1 if w.tied_head and pp == 1 else holds_embedding + holds_head
    fsdp_units = L + end_units if sharded else 0.0
    t_dispatch = (eff.block_overhead_s * dispatch_x * L + eff.fsdp_unit_overhead_s * fsdp_units) * n_mb * oversubscribed

    rm, ra, re = recompute_shares(plan)
    t_recompute = (rm * (t_mm - head_s) / 3 + ra * t_attn / 3 + rm * t_grouped / 3
                   + re * tok * L * fwd_ew * ew_scale / hbm)
    compute = t_mm + t_attn + t_grouped + t_ew

    # ---- collectives: every call the plan issues per step (tests/test_tp_comm.py counts them) ----
    colls: list[Collective] = []

    def add(name: str, nbytes: float, group: int, span: int, overlapped: bool, calls: float, kind: str = "",
            phase: str = "") -> None:
        if group <= 1 or calls <= 0:
            return
        link, bw = _link(span, hw)
        per_call = eff.collective_latency_s + (0.0 if overlapped else sync_point)
        seconds = nbytes / (bw * eff.link) + calls * per_call * latency_stretch
        kind = kind or next(k for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "send/recv")
                            if k in name).replace("-", "_").replace("/", "_")
        colls.append(Collective(name, nbytes, group, link, seconds, overlapped, calls, kind, phase))

    head = 0 if w.tied_head else w.head
    stage_params = (sum(w.layer_dense[i] + w.layer_norms[i] for i in layers) + w.embedding * holds_embedding
                    + (head + w.other_params) * holds_head)
    stage_experts = sum(w.layer_experts[i] for i in layers)
    moe_blocks = sum(1 for i in layers if w.layer_experts[i])
    dense_unit = stage_params / tp  # gathered elements per all-gather of the rank's dense params
    expert_unit = stage_experts / ep  # routed experts: split over EP; not TP-sharded
    efsdp = plan.dp_shard * cp * tp // ep if ep > 1 else fsdp
    span_fsdp = plan.dp_shard * cp * tp
    # bytes gathered per element: the compute dtype, float8 for the float8 Linears' weights under the
    # float8 all-gather (tensorwise: each shard cast before the gather; parallelisms/float8.py)
    f8_gathered = f8_weights / tp if plan.float8_all_gather and fp8_ok else 0.0
    dense_gather = dense_unit * esize - f8_gathered * (esize - 1)
    # Phases: FSDP gathers a unit ahead of its forward and again ahead of its backward, and
    # reduce-scatters (HSDP: then all-reduces) each unit's gradient behind the next unit's backward.
    # Under PP the units stay gathered (one gather per step, in the first microbatch's forward) and
    # the gradients are reduced once after the last microbatch ("end": nothing left to hide behind).
    if pp > 1:
        fwd_gather, fwd_calls, bwd_gather, bwd_calls = dense_gather, fsdp_units, 0.0, 0.0
        gather_phase, reduce_phase, reduces = "first forward", "end", 1
    else:  # the norm + head unit stays gathered from forward into backward
        ungathered = (head / tp + w.dim) * esize if holds_head and end_units == 2 else 0.0
        fwd_gather, fwd_calls = n_mb * dense_gather, n_mb * fsdp_units
        bwd_gather, bwd_calls = n_mb * (dense_gather - ungathered), n_mb * (fsdp_units - (end_units - 1))
        gather_phase, reduce_phase, reduces = "forward", "backward", n_mb
    for phase, nbytes, calls in ((gather_phase, fwd_gather, fwd_calls), ("backward", bwd_gather, bwd_calls)):
        add(f"FSDP all-gather ({phase})", nbytes * (fsdp - 1) / fsdp, fsdp, span_fsdp, True, calls, phase=phase)
    add("FSDP reduce-scatter", reduces * dense_unit * 4 * (fsdp - 1) / fsdp, fsdp, span_fsdp, True,
        reduces * fsdp_units, phase=reduce_phase)
    if stage_experts:
        expert_gathers = (((gather_phase, 1),) if pp > 1 else ((gather_phase, n_mb), ("backward", n_mb)))
        for phase, n in expert_gathers:
            add(f"expert FSDP all-gather ({phase})", n * expert_unit * esize * (efsdp - 1) / efsdp, efsdp, span_fsdp,
                True, n * moe_blocks, phase=phase)
        add("expert FSDP reduce-scatter", reduces * expert_unit * 4 * (efsdp - 1) / efsdp, efsdp, span_fsdp, True,
            reduces * moe_blocks, phase=reduce_phase)
    r = plan.dp_replicate
    if r > 1:
        shard_bytes = 4 * (dense_unit / fsdp + (expert_unit / efsdp if stage_experts else 0))
        add("HSDP all-reduce", reduces * 2 * shard_bytes * (r - 1) / r, r, r * span_fsdp, True,
            reduces * fsdp_units, phase=reduce_phase)
    act = tokens_mb / cp * w.dim * esize  # one microbatch's hidden states on a CP rank (full over TP)
    n_blocks = L
    if tp > 1:  # SP: a gather before attention and the MLP, a reduce-scatter after, forward and backward;
        # and the embedding's output and the head's input (the stage's ends under PP). A recompute
        # gathers again (full AC stops early, before the MLP's reduce-scatter; op AC saves neither
        # reduce-scatter)
        recomputes = plan.ac in ("full", "op", "budget")
        ends = n_mb * (holds_embedding + holds_head)
        for kind, per in (("all-gather", 4 + 2 * recomputes), ("reduce-scatter", 4 + (plan.ac == "full"))):
            add(f"TP/SP {kind}", (n_mb * n_blocks * per + ends) * act * (tp - 1) / tp, tp, tp, False,
                n_mb * n_blocks * per + ends)
        # Partial gradients of the replicated weights on sequence shards (the norms): one
        # all-reduce per step without FSDP (grad_reduce.py), one per norm weight with it (FSDP2's)
        norm_calls = reduces * (2 * n_blocks + holds_head) if sharded else 1
        # loss parallel: the vocab-sharded cross-entropy's max, sum and target logits
        add("TP gradient and loss all-reduces",
            4 * (sum(w.layer_norms[i] for i in layers) + w.dim + 3 * n_mb * tokens_mb / cp * holds_head),
            tp, tp, False, norm_calls + 4 * n_mb * holds_head, "all_reduce")
    if cp > 1:
        full = plan.ac == "full"  # op AC saves CP's collectives (CP_SAVE_OPS); full re-runs them
        if plan.cp_method == "allgather":  # K and V in one gather forward, their grads reduce-scattered backward
            mla = bool(w.layer_kv_up and any(w.layer_kv_up))  # MLA gathers its latent, whole on every TP rank
            kv = tokens_mb * w.kv_width / (1 if mla else tp) * esize
            add("CP K/V all-gather", n_mb * n_blocks * (1 + full) * kv * (cp - 1) / cp, cp, cp * tp, False,
                n_mb * n_blocks * (1 + full))
            add("CP K/V reduce-scatter", n_mb * n_blocks * kv * (cp - 1) / cp, cp, cp * tp, False, n_mb * n_blocks)
        else:  # Ulysses: q, k, v in (one all-to-all) and the output back, forward and backward
            width = w.qkvo_width
            if w.kv_heads:  # GQA: K/V heads repeated until cp divides them (context_parallel.py)
                from parallelisms.context_parallel import kv_repeat_for_alltoall

                repeat = kv_repeat_for_alltoall(w.n_heads // tp, max(1, w.kv_heads // tp), cp) or 1
                width += (repeat - 1) * w.kv_width
            qkvo = tokens_mb / cp * width / tp * esize
            per = 2 + full
            add("CP all-to-all (Ulysses)", n_mb * n_blocks * per * qkvo * (cp - 1) / cp, cp, cp * tp, False,
                n_mb * n_blocks * per * 2)
    if ep > 1 and w.moe_layers:
        rows = tokens_mb / shard * w.top_k * w.dim * esize  # routed rows this rank sends per MoE layer
        per = 4 + (2 if plan.ac == "full" else 0)  # rows out and back, forward and backward
        # and the forward's exchange of the split sizes (full AC's recompute exchanges them again)
        add("EP all-to-all", n_mb * moe_blocks * per * rows * (ep - 1) / ep, ep, ep, False,
            n_mb * moe_blocks * (per + (2 if plan.ac == "full" else 1)))
    if pp > 1:  # activations forward, their gradients backward
        sends = n_mb * plan.stages_per_rank * act / (tp if tp > 1 else 1)
        for phase in ("forward", "backward"):
            add(f"PP send/recv ({phase})", sends, 2, plan.world, True, n_mb * plan.stages_per_rank, phase=phase)

    # Per step: the loss and flags; the global token count (data ranks); the gradient norm (one
    # per mesh its gradients are sharded over); MoE loads for the bias update (trainer/train.py)
    moe_sum = w.moe_layers and plan.world // pp > 1
    norm_meshes = (fsdp > 1 or r > 1) + (tp > 1) + (ep > 1 and bool(w.moe_layers)) + (pp > 1)
    add("step all-reduces", 8 * (4 + w.moe_layers * 64), plan.world, plan.world, False,
        1 + (fsdp * r > 1) + norm_meshes + moe_sum, "all_reduce")
    if plan.float8_all_gather and fp8_ok and sharded:  # precomputed scales: one amax all-reduce per step
        add("float8 scale all-reduce", 4 * 8 * len(layers), fsdp, span_fsdp, False, 1, "all_reduce")
    serial = sum(c.seconds for c in colls if not c.overlapped)
    exposed_overlap = exposed_overlapped(colls, plan, hw, compute, t_recompute)
    busy = compute + t_recompute + serial
    t_bubble = bubble_fraction(plan) * busy
    local_params = (stage_params / tp / fsdp + (expert_unit / efsdp if stage_experts else 0))
    t_opt = local_params * 28 / hbm  # AdamW: read param, grad, 2 moments; write param, 2 moments (fp32)
    parts = {"matmul": t_mm, "attention": t_attn, "grouped GEMM": t_grouped, "elementwise": t_ew,
             "recompute": t_recompute, "exposed comm (TP/CP/EP)": serial,
             "exposed comm (FSDP/HSDP/PP)": exposed_overlap, "pipeline bubble": t_bubble,
             "optimizer step": t_opt,
             # host work per step (the loop, the optimizer's launches, clipping): shares the cores too
             "fixed overhead": eff.step_overhead_s * oversubscribed, "eager dispatch": t_dispatch}
    return StepTime(plan, parts, colls, tokens_per_step=plan.global_batch * seq_len,
                    flops_per_token=w.flops_per_token(seq_len), peak_flops=hw.bf16_tflops * 1e12)
