"""Muon on one process: Newton-Schulz against an fp64 reference, the param-group rule,
the AdamW side, the config's bad inputs, and a short training run (float8 too)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import TINY, run_in_process
from trainer.config import load_config
from configuration.fields import ConfigError
from trainer.muon import Muon, newton_schulz, split_params, update_scale
from trainer.optim import build_optimizer


def reference_ns(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration written out in fp64 on one matrix: X <- a X + b (X X^T) X + c (X X^T)^2 X."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + b * s @ x + c * s @ s @ x
    return x.T if transpose else x


@pytest.mark.parametrize("shape", [(48, 48), (32, 80), (96, 24)])
def test_newton_schulz_matches_fp64_reference_and_orthogonalises(shape):
    torch.manual_seed(0)
    k = min(shape)
    # singular values spread over a decade, as a gradient's are
    u, _ = torch.linalg.qr(torch.randn(3, shape[0], k))
    v, _ = torch.linalg.qr(torch.randn(3, shape[1], k))
    g = u @ torch.diag_embed(torch.logspace(0, -1, k).expand(3, k)) @ v.mT
    out = newton_schulz(g, 5, torch.float32)
    assert out.shape == g.shape and out.dtype == torch.float32
    for i in range(3):
        ref = reference_ns(g[i])
        assert (out[i].double() - ref).abs().max().item() < 1e-4
        # Orthogonal up to the quintic's band: the singular values sit in about [0.7, 1.2]
        # (an exactly orthogonal U V^T has all of them 1); the input's spread far wider.
        sv = torch.linalg.svdvals(out[i].double())
        assert sv.min() > 0.6 and sv.max() < 1.25, sv
        # and its singular vectors are the input's: out ~ U V^T
        u, _, vh = torch.linalg.svd(g[i].double(), full_matrices=False)
        assert (out[i].double() - u @ vh).norm() / (u @ vh).norm() < 0.3
    # bf16 (the GPU precision) stays close to the fp32 result
    assert (newton_schulz(g, 5, torch.bfloat16) - out).abs().max() < 0.1


def test_update_scale_rules():
    assert update_scale(torch.Size([192, 64]), "rms", 0.2) == pytest.approx(0.2 * 192 ** 0.5)
    assert update_scale(torch.Size([192, 64]), "spectral", 0.2) == pytest.approx(3 ** 0.5)  # fan_out / fan_in = 3
    assert update_scale(torch.Size([64, 192]), "spectral", 0.2) == 1.0
    # grouped experts [E, in, out]: fan_out is the last dim
    assert update_scale(torch.Size([8, 64, 192]), "spectral", 0.2) == pytest.approx(3 ** 0.5)


def _meta_model(name: str, flavor: str, *extra: str):
    cfg = load_config(["--model.name", name, "--model.flavor", flavor, *extra])
    with torch.device("meta"):
        return cfg, cfg.model_spec.model_cls(cfg.model_args)


@pytest.mark.parametrize("name,flavor", [("llama3", "debug_small"), ("deepseek_v3", "debug")])
def test_param_rule_puts_hidden_matrices_on_muon(name, flavor):
    cfg, model = _meta_model(name, flavor)
    o = cfg.optimizer
    muon, adamw, names = split_params(model.named_parameters(), o.muon_params, o.muon_exclude)
    by_name = dict(model.named_parameters())
    on_adamw = [n for n, p in by_name.items() if all(p is not q for q in muon)]
    assert len(muon) + len(adamw) == len(by_name)
    for n in names:
        assert n.startswith("layers.") and by_name[n].ndim >= 2 and "norm" not in n and "router" not in n
        assert any(k in n for k in ("attention.w", "feed_forward.w", "experts.w", "shared_experts.w")), n
    for n in on_adamw:  # embeddings, head, norms, router, biases
        assert (n in ("tok_embeddings.weight", "output.weight") or "norm" in n or "router" in n
                or by_name[n].ndim < 2), n
    assert "layers.0.attention.wo.weight" in names and "layers.0.feed_forward.w2.weight" in names
    if name == "deepseek_v3":
        assert "layers.1.moe.experts.w1" in names and "layers.1.moe.router.gate.weight" in on_adamw


def test_mtp_modules_stay_on_adamw():
    cfg, model = _meta_model("deepseek_v3", "debug", "--model.mtp_depth", "1")
    names = split_params(model.named_parameters(), cfg.optimizer.muon_params, cfg.optimizer.muon_exclude)[2]
    assert any(n.startswith("mtp.") for n, _ in model.named_parameters())
    assert not any(n.startswith("mtp.") for n in names)


def test_adamw_groups_equal_torch_adamw_and_muon_moves_matrices():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    ref = [p.detach().clone() for p in net.parameters()]
    cfg = load_config(["--optimizer.name", "muon", "--optimizer.muon_params", "0.*",
                       "--optimizer.muon_exclude", ""]).optimizer
    opt = build_optimizer(net, cfg, "cpu")
    assert isinstance(opt, Muon) and [g["muon"] for g in opt.param_groups] == [True, False]
    ref_params = [torch.nn.Parameter(t) for t in ref[1:]]  # 0.bias, 1.weight, 1.bias on AdamW
    ref_opt = torch.optim.AdamW(ref_params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                weight_decay=cfg.weight_decay, foreach=True)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in net.parameters()]
        for p, g in zip(net.parameters(), grads):
            p.grad = g.clone()
        for p, g in zip(ref_params, grads[1:]):
            p.grad = g.clone()
        opt.step()
        ref_opt.step()
    for p, r in zip(list(net.parameters())[1:], ref_params):
        assert torch.equal(p, r)
    w = net[0].weight
    assert set(opt.state[w]) == {"momentum_buffer"} and not torch.equal(w, ref[0])


def test_muon_step_holds_one_stack_at_a_time_and_the_estimate_is_its_peak(monkeypatch):
    """The step builds, orthogonalises and applies one stack (here: one parameter) before the
    next, and runs NS on a stack's matrices in chunks (NS_CHUNK_BOUND): the bytes its ops
    allocate (LiveBytesTracker, with the parameters, gradients and momentum buffers excluded)
    peak at exactly what the memory estimator counts (trainer/memory/optimizer_terms.py), for
    NS on all 16 matrices of the 3-D parameter at once (bound inf), in chunks of 3 (bound 1,
    the default) and one by one (bound 0); the chunked peak is the smaller. The updates are
    bitwise equal to one Nesterov NS step on each parameter's matrices at once: on CPU a
    matrix's NS does not depend on its batch. Before the stacks, every update and every result
    were held together (382464 bytes without the 3-D parameter)."""
    import parallelisms.muon_assembly as assembly
    from trainer.memory import LiveBytesTracker
    from trainer.memory.optimizer_terms import _muon_step

    shapes = [(64, 48)] * 6 + [(48, 96)] * 4 + [(16, 40, 24)]
    lr, mu = 0.01, 0.95
    peaks = {}
    for bound in (math.inf, 1.0, 0.0):
        monkeypatch.setattr(assembly, "NS_CHUNK_BOUND", bound)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        opt = Muon([{"params": params, "muon": True, "lr": lr, "momentum": mu}])
        bufs = [torch.zeros_like(p) for p in params]
        for _ in range(2):
            want = []
            for p, b in zip(params, bufs):
                p.grad = torch.randn_like(p)
                b.mul_(mu).add_(p.grad)
                ns = newton_schulz(p.grad.add(b, alpha=mu).reshape(-1, *p.shape[-2:]), 5).reshape(p.shape)
                want.append(p.detach().add(ns, alpha=-lr * update_scale(p.shape, "rms", 0.2)))
            existing = params + [p.grad for p in params] + [v for st in opt.state.values() for v in st.values()]
            with LiveBytesTracker(existing) as tracker:
                opt.step()
            assert all(torch.equal(p, w) for p, w in zip(params, want)), bound
        predicted = _muon_step({str(i): (s, s, 1, 1) for i, s in enumerate(shapes)}, 4)
        print(f"NS_CHUNK_BOUND {bound}: {tracker.peak} bytes allocated at the step's peak, estimate {predicted}, "
              f"parameters {sum(p.numel() for p in params) * 4}")
        assert tracker.peak == predicted, bound
        peaks[bound] = tracker.peak
    one_param = 16 * 40 * 24 * 4
    assert peaks[0.0] <= peaks[1.0] < peaks[math.inf] / 2
    assert peaks[1.0] <= 2 * one_param  # the 3-D parameter's stack and its fp32 Nesterov update


def test_unknown_optimizer_and_empty_rule_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="optimizer.name"):
        load_config(["--optimizer.name", "sgd"])
    cfg, model = _meta_model("llama3", "debug_small", "--optimizer.name", "muon", "--optimizer.muon_params",
                             "layers.*,blocks.*")
    with pytest.raises(ConfigError, match=r"optimizer.muon_params: 'blocks\.\*' matches no") as e:
        build_optimizer(model, cfg.optimizer, "cpu")
    assert "\n" not in str(e.value)
    # Through ./run_train.sh (one line, exit 2, no traceback): tests/test_bad_inputs.py.


def test_muon_params_are_checked_over_the_whole_model_not_one_stage():
    """Under PP a stage holds some blocks: a pattern matching only another stage's parameters
    is fine, one matching nothing in the whole model is still a one-line error. (End to end,
    PP 2 with one pattern per stage: `muon_pp2_split_patterns` in tests/test_muon_layouts.py.)"""
    cfg, stage0 = _meta_model("llama3", "debug_small", "--optimizer.name", "muon", "--optimizer.muon_params",
                              "layers.0.*,layers.2.*")
    whole = list(stage0.named_parameters())
    del stage0.layers["2"]  # this stage: blocks 0 and 1
    opt = build_optimizer(stage0, cfg.optimizer, "cpu", whole_model=whole)
    muon = [p for g in opt.param_groups if g["muon"] for p in g["params"]]
    assert muon and all(any(p is q for q in stage0.layers["0"].parameters()) for p in muon)
    with pytest.raises(ConfigError, match=r"'layers\.2\.\*' matches no"):  # this part alone
        build_optimizer(stage0, cfg.optimizer, "cpu")
    cfg.optimizer.muon_params = ["layers.0.*", "layers.7.*"]
    with pytest.raises(ConfigError, match=r"'layers\.7\.\*' matches no"):
        build_optimizer(stage0, cfg.optimizer, "cpu", whole_model=whole)


def test_training_with_muon_lowers_the_loss(tmp_path):
    losses, trainer = run_in_process(TINY + ["--training.steps", "12", "--optimizer.name", "muon",
                                             "--optimizer.lr", "3e-3", "--job.dump_folder", str(tmp_path)])
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses


def test_muon_with_float8_updates_the_fp32_master_weights(tmp_path):
    """Float8Linear keeps fp32 weights (only its matmuls cast): Muon's NS and update run on
    them, and the loss stays close to the high-precision Muon run's."""
    import torchao  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)
    from torchao.float8.float8_linear import Float8Linear

    args = TINY + ["--training.steps", "4", "--optimizer.name", "muon", "--optimizer.lr", "3e-3",
                   "--training.mixed_precision_param", "float32"]
    ref, _ = run_in_process(args + ["--job.dump_folder", str(tmp_path / "ref")])
    got, trainer = run_in_process(args + ["--float8.enable", "true", "--job.dump_folder", str(tmp_path / "f8")])
    model, opt = trainer.model_parts[0], trainer.optimizers[0]
    f8 = [m.weight for m in model.modules() if isinstance(m, Float8Linear)]
    muon = {id(p) for g in opt.param_groups if g["muon"] for p in g["params"]}
    assert f8 and all(id(w) in muon and w.dtype == torch.float32 for w in f8)
    assert all("momentum_buffer" in opt.state[w] for w in f8)
    assert got != ref and max(abs(a - b) / b for a, b in zip(got, ref)) < 0.02, (got, ref)
