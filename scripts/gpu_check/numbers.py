"""Checks the numbers of trainer rows against their group's reference (no torch import).

A trainer row runs the same weights on the same batches as its reference (eager, AC none):
its losses, gradient norms and per-parameter gradient norms at `plan.NUMBERS_STEPS` must
agree within the tolerance of its precision, or the row reads MISMATCH. Step 1 checks
what AC and compile do to one forward and backward; the last compared step runs op SAC's
replayed forward and direct recompute (from a block's third call on), which no CUDA
attention output had reached before the first GPU run.

A row's "numbers" entry (bench.measure's figures, one run per depth):

    {"group": "llama", "reference": false, "label": "eager, AC none", "precision": "bf16",
     "runs": {"4 layers": {"loss": [per step], "grad_norm": [per step, before clipping],
                           "params": {"1": {name: grad norm before clipping}, "5": {...}}}}}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpu_check.plan import NUMBERS_STEPS

COLUMN = "loss / grad norm (step 1)"


@dataclass(frozen=True)
class Tolerance:
    """Relative differences allowed: the loss, the total grad norm, each parameter's grad norm.

    bf16: two implementations of one bf16 step round differently at each op (2^-9 relative
    per element), which leaves the loss within ~1e-4 and gradient norms within ~1e-3, far
    under these bounds; a wrong recompute (a stale or misplaced tensor, a lost gradient
    path) moves some parameter's gradient by tens of percent. float8: e4m3 inputs and e5m2
    gradients (3 and 2 mantissa bits) move each gradient element by up to 6-12%, averaged
    over the 16k tokens of a step."""

    loss: float
    grad_norm: float
    param: float


TOLERANCES = {"bf16": Tolerance(loss=5e-3, grad_norm=2e-2, param=5e-2),
              "float8": Tolerance(loss=2e-2, grad_norm=0.1, param=0.25)}
# A parameter whose reference grad norm is under this fraction of the total is compared
# against that floor, not against its own (near-zero) norm.
PARAM_FLOOR = 1e-3


def _rel(a: float, b: float, floor: float = 0.0) -> float:
    return abs(a - b) / max(abs(b), floor, 1e-30)


def _finite(numbers: dict) -> str:
    """'' when every loss and grad norm is finite, else the first that is not."""
    for run, r in numbers.get("runs", {}).items():
        for key in ("loss", "grad_norm"):
            for step, v in enumerate(r.get(key, []), 1):
                if not math.isfinite(v):
                    return f"{key.replace('_', ' ')} {v} at step {step}, {run}"
    return ""


def compare(numbers: dict, ref: dict) -> tuple[list[str], dict]:
    """(what is beyond tolerance, the worst differences) of `numbers` against `ref`, over the
    runs (depths) both have and the steps of NUMBERS_STEPS both reached."""
    tol = TOLERANCES[numbers.get("precision", "bf16")]
    bad: list[str] = []
    worst = {"loss": 0.0, "grad norm": 0.0, "param": 0.0, "param name": "", "compared": []}
    for run, r in numbers.get("runs", {}).items():
        q = ref.get("runs", {}).get(run)
        if q is None:
            continue
        for step in NUMBERS_STEPS:
            i = step - 1
            if i >= min(len(r["loss"]), len(q["loss"])):
                continue
            worst["compared"].append((run, step))
            for key, name, bound in (("loss", "loss", tol.loss), ("grad_norm", "grad norm", tol.grad_norm)):
                rel = _rel(r[key][i], q[key][i])
                worst[name] = max(worst[name], rel)
                if rel > bound:
                    bad.append(f"{run}, step {step}: {name} {r[key][i]:.6g} vs {q[key][i]:.6g} (rel {rel:.1e} > "
                               f"{bound:g})")
            mine, theirs = r.get("params", {}).get(str(step)), q.get("params", {}).get(str(step))
            if mine is None or theirs is None:
                continue
            if set(mine) != set(theirs):
                diff = sorted(set(mine) ^ set(theirs))
                bad.append(f"{run}, step {step}: the parameters differ ({', '.join(diff[:3])})")
                continue
            floor = PARAM_FLOOR * q["grad_norm"][i]
            for name, v in mine.items():
                rel = _rel(v, theirs[name], floor)
                if rel > worst["param"]:
                    worst.update({"param": rel, "param name": name})
                if rel > tol.param:
                    bad.append(f"{run}, step {step}: {name}'s grad norm {v:.4g} vs {theirs[name]:.4g} (rel {rel:.1e} "
                               f"> {tol.param:g})")
    return bad, worst


def _cell(numbers: dict) -> str:
    runs = numbers.get("runs", {})
    if not runs:
        return ""
    r = runs[sorted(runs)[-1]]  # the deepest run ("4 layers" after "2 layers")
    return f"{r['loss'][0]:.4f} / {r['grad_norm'][0]:.4f}" if r.get("loss") else ""


def judge(rows: list[dict]) -> list[dict]:
    """The rows with their numbers checked: the column filled in, and each row with numbers
    marked MISMATCH (numbers beyond tolerance, or not finite) or told how close it is."""
    refs = {}
    for r in rows:
        n = r.get("numbers")
        if n and n.get("reference") and str(r.get("result", "")).startswith("ok"):
            refs.setdefault(n["group"], r)
    out = []
    for r in rows:
        n = r.get("numbers")
        if not n or not str(r.get("result", "")).startswith("ok"):
            out.append(r)
            continue
        r = {**r, COLUMN: _cell(n)}
        broken = _finite(n)
        ref = refs.get(n["group"])
        if broken:
            r["result"] = f"MISMATCH: {broken}; {r['result']}"
        elif n.get("reference"):
            r["result"] += f"; numbers: the reference of its group ({n['group']})"
        elif ref is None:
            r["result"] += f"; numbers not compared: the group's reference ({n['group']}) did not finish"
        else:
            label = ref["numbers"].get("label", ref.get("section", "?"))
            bad, worst = compare(n, ref["numbers"])
            if bad:
                r["result"] = f"MISMATCH vs {label}: {'; '.join(bad[:3])}" + \
                    (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "") + f"; {r['result']}"
            elif not worst["compared"]:
                r["result"] += f"; numbers not compared: no depth and step in common with {label}"
            else:
                steps = sorted({s for _, s in worst["compared"]})
                runs = sorted({run for run, _ in worst["compared"]})
                r["result"] += (f"; numbers as {label} ({n.get('precision', 'bf16')} tolerance), steps "
                                f"{', '.join(map(str, steps))} at {', '.join(runs)}: loss rel {worst['loss']:.1e}, "
                                f"grad norm rel {worst['grad norm']:.1e}, worst parameter rel {worst['param']:.1e}"
                                + (f" ({worst['param name']})" if worst["param name"] else ""))
        out.append(r)
    return out
