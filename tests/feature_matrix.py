"""The pairwise feature matrix (tests/test_feature_matrix.py, docs/feature_matrix.md): its
factors, the tiny model flavors it trains, the all-pairs generator, and the CLI overrides of
one row and of its one-rank reference.

Factors: the parallelism (FSDP, TP, PP, CP or EP, each of degree 2 on 2 ranks), the AC mode,
the optimizer, float8, compile, the model, and an odd or even layer count. Testing every
combination (5 x 4 x 2 x 2 x 2 x 3 x 2 = 960 runs) is out of reach; testing every *pair* of
values of two factors in at least one run is not: `all_pairs` builds a covering design of
about 20 rows, greedily (each new row covers as many uncovered pairs as it can among a few
seeded random candidates, AETG-style), deterministic for a given seed.

Some pairs cannot train together and must be refused (`REFUSED`: exit 2, one line naming the
field and the fix); some train but do not equal one rank (`KNOWN_FAILURES`, xfail). Both are
kept out of the design's rows, and each gets a row of its own whose other values are ordinary,
so that its outcome has one cause and every other pair is checked in a row that must be equal.

`register_flavors` adds the `matrix_odd` / `matrix_even` flavors of the three models (Llama 3,
DeepSeek V3, Qwen3-MoE) to their specs: the test process for the length of its matrix tests
(`flavors_registered`), the worker processes (tests/parallel_worker.py) through a case's "import"
of tests/feature_matrix_flavors.py, so that both build the same shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random

from models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from models.llama3.args import LLAMA3_FLAVORS
from models.qwen3.args import QWEN3_FLAVORS, Qwen3Args

FACTORS: dict[str, tuple[str, ...]] = {
    "parallel": ("fsdp", "tp", "pp", "cp", "ep"),
    "ac": ("none", "full", "op", "budget"),
    "optimizer": ("AdamW", "muon"),
    "float8": ("off", "on"),
    "compile": ("off", "on"),
    "model": ("llama3", "deepseek_v3", "qwen3_moe"),
    "layers": ("odd", "even"),
}
SEED = 0

# Pairs that must be refused, each with the one line that refuses it (a substring of it).
REFUSED: dict[tuple[tuple[str, str], tuple[str, str]], str] = {
    (("parallel", "ep"), ("model", "llama3")):
        "config error: parallelism.expert_parallel_degree: 2, but the model has no routed experts; set it to 1",
    (("ac", "budget"), ("compile", "on")):
        "config error: activation_checkpoint.mode: budget is the eager memory budget; under compile.enable use "
        "mode memory_budget",
}

# Pairs the model's defaults refuse, each with the one line and the fix it names. The design's
# rows holding the pair train with the fix (and must equal one rank); one more row holds the pair
# with the defaults and must be refused with the line.
# A key may hold more than two values: the refusal needs all of them.
FIXED: dict[tuple[tuple[str, str], ...], tuple[str, list[str]]] = {
    (("parallel", "cp"), ("float8", "on"), ("model", "deepseek_v3")): (
        "config error: parallelism.context_parallel_method: allgather gathers MLA's latent before wkv_b, so under "
        "float8 each CP rank casts a partial gradient of wkv_b's output; use context_parallel_method = \"alltoall\" "
        "or add wkv_b to float8.filter_fqns", ["--parallelism.context_parallel_method", "alltoall"]),
    (("parallel", "pp"), ("model", "qwen3_moe")): (
        "config error: moe.aux_loss_scope: 'model' pools the routing of every MoE layer into one balance loss "
        "(HF's), which pipeline stages cannot share; under pipeline_parallel_degree 2 use --moe.aux_loss_scope "
        "batch (one loss per layer) or --moe.aux_loss_coeff 0", ["--moe.aux_loss_scope", "batch"]),
}

# Pairs that train but do not equal one rank, each with why (pytest.mark.xfail(strict=True) in the
# test). Like the refused pairs they are kept out of the other rows, so every other pair is checked.
KNOWN_FAILURES: dict[tuple[tuple[str, str], tuple[str, str]], str] = {}


# ---- the models: a few layers, small dims; odd (3) and even (2) layer counts ----
_LLAMA = dataclasses.replace(LLAMA3_FLAVORS["debug_small"], max_seq_len=256)  # dim 64, GQA 4/2 heads
# 1 dense block then MoE blocks: 8 experts top 2, one shared expert, MLA with q LoRA, sigmoid routing.
_DEEPSEEK = DeepSeekV3Args(
    vocab_size=2048, dim=64, n_layers=3, n_dense_layers=1, inter_dim=128, max_seq_len=256,
    moe_inter_dim=32, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
    n_expert_groups=1, n_limited_groups=1, score_func="sigmoid", route_scale=1.0,
    n_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    rope_factor=1.0, aux_loss_coeff=0.01)  # and its sequence balance loss, beside the bias update
# Qwen3-MoE: 1 dense block (mlp_only_layers) then MoE blocks: 8 experts top 2, softmax routing, QK-norm,
# the real flavors' balance loss (HF's, pooled over the model's MoE layers: scope "model").
_QWEN3_MOE = dataclasses.replace(QWEN3_FLAVORS["debug_moe"], dim=64, n_layers=3, n_heads=4, n_kv_heads=2,
                                 head_dim=16, ffn_hidden_dim=128, moe_inter_dim=32, max_seq_len=256,
                                 aux_loss_coeff=0.01, aux_loss_scope="model")
LAYERS = {"odd": 3, "even": 2}
_FLAVOR_TABLES = {"llama3": (LLAMA3_FLAVORS, _LLAMA), "deepseek_v3": (DEEPSEEK_V3_FLAVORS, _DEEPSEEK),
                  "qwen3_moe": (QWEN3_FLAVORS, _QWEN3_MOE)}


def register_flavors() -> list[tuple[dict, str]]:
    """Adds the `matrix_odd` / `matrix_even` flavors to the three models' tables; returns what it
    added. Not done at import: a flavor left in a table for the rest of a pytest process makes
    another test's shape inference ambiguous (Llama's matrix_odd has debug_small's shapes)."""
    added = []
    for table, base in _FLAVOR_TABLES.values():
        for parity, n in LAYERS.items():
            if f"matrix_{parity}" not in table:
                table[f"matrix_{parity}"] = dataclasses.replace(base, n_layers=n)
                added.append((table, f"matrix_{parity}"))
    return added


@contextlib.contextmanager
def flavors_registered():
    """The matrix flavors, for the length of a `with` (the test process's references and checks)."""
    added = register_flavors()
    try:
        yield
    finally:
        for table, name in added:
            del table[name]

assert isinstance(_QWEN3_MOE, Qwen3Args) and _QWEN3_MOE.n_moe_layers == 2


# ---- the covering design ----
Pair = tuple[tuple[str, str], tuple[str, str]]


def pair(a: tuple[str, str], b: tuple[str, str]) -> Pair:
    """The canonical (sorted) form of a pair of (factor, value)."""
    return (a, b) if a <= b else (b, a)


def pairs_of(row: dict[str, str]) -> set[Pair]:
    """Every pair of (factor, value) of `row`, canonical."""
    return {pair(a, b) for a, b in itertools.combinations(row.items(), 2)}


def all_pairs(factors: dict[str, tuple[str, ...]], excluded: set[Pair] = frozenset(), seed: int = SEED,
              candidates: int = 30) -> list[dict[str, str]]:
    """Rows (factor -> value) in which every pair of values of two factors appears at least once,
    except the `excluded` pairs, which appear in none. Greedy: each row is the best of
    `candidates` seeded random constructions (start from an uncovered pair, then give every other
    factor, in random order, the value that covers the most uncovered pairs with the values set
    so far, never completing an excluded pair)."""
    names = list(factors)
    excluded = {pair(*p) for p in excluded}
    uncovered = {pair(a, b) for f, g in itertools.combinations(names, 2)
                 for a, b in itertools.product([(f, v) for v in factors[f]], [(g, v) for v in factors[g]])} - excluded
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    while uncovered:
        best, best_new = None, -1
        for _ in range(candidates):
            (f1, v1), (f2, v2) = rng.choice(sorted(uncovered))
            row = {f1: v1, f2: v2}
            rest = [f for f in names if f not in row]
            rng.shuffle(rest)
            for f in rest:
                scored = []
                for v in factors[f]:
                    new = {pair((f, v), (g, row[g])) for g in row}
                    if not new & excluded:
                        scored.append((len(new & uncovered), rng.random(), v))
                if not scored:
                    raise ValueError(f"every value of {f} completes an excluded pair with {row}")
                row[f] = max(scored)[2]
            gain = len(pairs_of(row) & uncovered)
            if gain > best_new:
                best, best_new = {f: row[f] for f in names}, gain
        rows.append(best)
        uncovered -= pairs_of(best)
    return rows


DEFAULTS = {f: values[0] for f, values in FACTORS.items()}


def isolated_row(values) -> dict[str, str]:
    """A row holding `values` ((factor, value), ...) and otherwise the first value of each factor
    (none of which is refused)."""
    row = dict(DEFAULTS)
    row.update(dict(values))
    return row


def holds(row: dict[str, str], values) -> bool:
    return all(row[f] == v for f, v in values)


def matrix() -> list[tuple[str, dict[str, str], str, str]]:
    """(name, row, expected outcome, its text) for every row of the matrix: the rows of the
    covering design ("equal", text ""), then one row per REFUSED pair ("refused", the line) and
    per KNOWN_FAILURES pair ("xfail", why)."""
    def name(prefix: str, i: int, row: dict[str, str]) -> str:
        return f"{prefix}{i:02d}_" + "_".join(row[f] for f in FACTORS)

    out = [(name("r", i, row), row, "equal", "")
           for i, row in enumerate(all_pairs(FACTORS, set(REFUSED) | set(KNOWN_FAILURES)))]
    refused = {**REFUSED, **{p: line for p, (line, _) in FIXED.items()}}
    for prefix, kind, table in (("x", "refused", refused), ("f", "xfail", KNOWN_FAILURES)):
        for i, (pair_, text) in enumerate(table.items()):
            row = isolated_row(pair_)
            out.append((name(prefix, i, row), row, kind, text))
    return out


# ---- one row as CLI overrides ----
STEPS = 3
GLOBAL_BATCH = 4  # samples per optimizer step; 2 samples per one-rank microbatch: 2 microbatches per step
COMMON = ["--data.type", "synthetic", "--training.seq_len", "64", "--training.global_batch_size", str(GLOBAL_BATCH),
          "--training.steps", str(STEPS), "--optimizer.lr", "1e-4", "--optimizer.muon_lr", "2e-3",
          "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1.0", "--training.max_norm", "0.3",
          "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false"]
MODEL_NAMES = {"llama3": "llama3", "deepseek_v3": "deepseek_v3", "qwen3_moe": "qwen3"}
LB, MB = "--training.local_batch_size", "--parallelism.pipeline_parallel_microbatch_size"
# parallel -> (layout args on 2 ranks, samples of one forward over the data-parallel ranks, samples of
# one forward on one rank)
LAYOUTS: dict[str, tuple[list[str], int, int]] = {
    "fsdp": ([LB, "1"], 2, 1),  # dp 2 x 1 sample
    "tp": ([LB, "2", "--parallelism.tensor_parallel_degree", "2"], 2, 2),  # SP and loss parallel on
    "pp": ([LB, "2", "--parallelism.pipeline_parallel_degree", "2", MB, "1"], 1, 1),  # 1F1B, 2 microbatches of 1
    "cp": ([LB, "2", "--parallelism.context_parallel_degree", "2"], 2, 2),  # allgather, FSDP over cp
    "ep": ([LB, "1", "--parallelism.expert_parallel_degree", "2"], 2, 1),  # dp 2, experts split over 2
}


def model_args(row: dict[str, str], fixes: bool = True) -> list[str]:
    """The row's model, optimizer and float8: what its one-rank reference shares; with `fixes`,
    the fix of each FIXED pair the row holds.

    Qwen3's batch-scope balance loss counts one forward over the data-parallel ranks, float8
    scales one rank's forward: when those differ (FSDP, EP: 2 samples vs 1), no one-rank run
    reproduces both, so such a float8 row uses the sequence scope, which any split adds up to."""
    args = ["--model.name", MODEL_NAMES[row["model"]], "--model.flavor", f"matrix_{row['layers']}",
            "--optimizer.name", row["optimizer"]]
    if row["float8"] == "on":
        args += FLOAT8
        _, dp_forward, rank_forward = LAYOUTS[row["parallel"]]
        if row["model"] == "qwen3_moe" and dp_forward != rank_forward:
            args += ["--moe.aux_loss_scope", "sequence"]
    if fixes:
        for pair_, (_, fix) in FIXED.items():
            if holds(row, pair_) and fix[0] not in args:
                args += fix
    return args


FLOAT8 = ["--float8.enable", "true"]


# aot_eager: dynamo and AOT autograd trace the DTensor / PP / EP graphs as for inductor, without
# inductor's C++ codegen (minutes per block shape on 2 shared cores).
COMPILE = ["--compile.enable", "true", "--compile.backend", "aot_eager"]


def row_args(row: dict[str, str], fixes: bool = True) -> list[str]:
    """The overrides of one row on 2 ranks (without job.dump_folder); `fixes` as in model_args."""
    args = [*COMMON, *model_args(row, fixes), *LAYOUTS[row["parallel"]][0], "--activation_checkpoint.mode", row["ac"]]
    return args + COMPILE if row["compile"] == "on" else args


def compiled_reference(row: dict[str, str]) -> bool:
    """A compiled float8 row's reference is compiled too. Compiled and eager fp32 differ in the
    last bits (a fused op rounds once), which float8 casts magnify: an element that crosses a
    rounding boundary of e4m3 moves by up to 1/16 of itself, one that sets a tensor's amax moves
    its scale. Measured on one rank (DeepSeek V3, Muon, 3 steps): compiled vs eager float8
    gradients max-rel 9.4e-2 (0.38 of float8's own effect), vs 1e-7-level in fp32."""
    return row["float8"] == "on" and row["compile"] == "on"


def reference_microbatch(row: dict[str, str]) -> int:
    """Samples per forward of the row's one-rank reference: those one forward covers on one rank
    under float8 (dynamic scales are taken over what one rank multiplies), else those one forward
    covers over the data-parallel ranks (what Qwen3's batch-scope balance loss counts)."""
    _, dp_forward, rank_forward = LAYOUTS[row["parallel"]]
    return rank_forward if row["float8"] == "on" else dp_forward


def reference_key(row: dict[str, str]) -> tuple:
    """Rows with equal keys share one reference run."""
    return (row["model"], row["layers"], row["optimizer"], row["float8"], reference_microbatch(row),
            compiled_reference(row))


def reference_args(row: dict[str, str]) -> list[str]:
    """One rank, no AC, eager (compiled: see `compiled_reference`), on the same global batches in
    the same microbatches as the row."""
    args = [*COMMON, *model_args(row), LB, str(reference_microbatch(row))]
    return args + COMPILE if compiled_reference(row) else args


def fp32_reference_args(row: dict[str, str]) -> list[str]:
    """A float8 row's reference without float8: how far float8 itself moves the numbers."""
    args = reference_args(row)
    i = args.index(FLOAT8[0])
    return args[:i] + args[i + len(FLOAT8):]


def markdown_table() -> str:
    """The rows and their expected outcomes as a markdown table (docs/feature_matrix.md holds it)."""
    lines = ["| row | " + " | ".join(FACTORS) + " | outcome |", "|---" * (len(FACTORS) + 2) + "|"]
    for name, row, kind, text in matrix():
        outcome = {"equal": "equal", "refused": f"refused: `{text}`",
                   "xfail": "**not equal** (xfail, see below)"}[kind]
        lines.append(f"| {name.split('_')[0]} | " + " | ".join(row[f] for f in FACTORS) + f" | {outcome} |")
    return "\n".join(lines)


def pairs_table() -> str:
    """Every pair of values of two factors and the rows that hold it, as a markdown table: one line
    per (factor, value), one column per other factor; a cell lists each value of that factor with
    the rows holding the pair: r.. must equal one rank; x.. refused (for a FIXED pair, the r.. rows
    train with the fix); f.. not equal."""
    rows = matrix()
    isolated = [p for p in [*REFUSED, *FIXED, *KNOWN_FAILURES] if len(p) == 2]
    lines = ["| value | " + " | ".join(FACTORS) + " |", "|---" * (len(FACTORS) + 1) + "|"]
    for f, values in FACTORS.items():
        for v in values:
            cells = []
            for g, others in FACTORS.items():
                if g == f:
                    cells.append("")
                    continue
                parts = []
                for w in others:
                    key = pair((f, v), (g, w))
                    ids = [name.split("_")[0] for name, row, kind, _ in rows if row[f] == v and row[g] == w
                           and (kind == "equal" or key in {pair(*p) for p in isolated})]
                    parts.append(f"{w}: {' '.join(ids[:2])}")
                cells.append("<br>".join(parts))
            lines.append(f"| {f}={v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
