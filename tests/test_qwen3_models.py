"""Qwen3 (dense and MoE) against transformers: flavor sizes, logits, config translation.

- Every published flavor's dry-run parameter count equals that of transformers' model built
  from the Hub config on the meta device (the Hub configs are written out below).
- Logits of our model loaded from a random folder that transformers saved equal
  transformers' within 1e-4 in fp32, for dense and MoE, tied and untied, in both config.json
  spellings (rope_parameters, and the legacy rope_theta); the export loads back in
  transformers with the same logits and the same tensors.
- A folder of a Qwen model type we lack (qwen3_next) is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import transformers  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)
import safetensors  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)

from models import get_model_spec  # noqa: E402
from models.hf_config import HFConfigError, model_from_hf_folder  # noqa: E402
from tests.hf_builders import hf_logits, our_model_from_hf, save_random_gqa_folder, tokens_for  # noqa: E402
from trainer.hf_io import HFReader, save_hf  # noqa: E402

TOL = 1e-4

_COMMON = {"vocab_size": 151936, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
           "rope_theta": 1000000.0, "hidden_act": "silu", "attention_bias": False}
# The numbers of the Hub's config.json files (Qwen/Qwen3-*), dense then MoE.
HUB_CONFIGS = {
    "0.6B": {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "1.7B": {"model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "4B": {"model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
           "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "8B": {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
           "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "14B": {"model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
            "num_attention_heads": 40, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "32B": {"model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
            "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "30B-A3B": {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False,
                "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": []},
    "235B-A22B": {"model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
                  "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
                  "tie_word_embeddings": False, "moe_intermediate_size": 1536, "num_experts": 128,
                  "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
}


def _hf_config(fields: dict):
    from transformers import Qwen3Config, Qwen3MoeConfig

    fields = {**_COMMON, **fields}
    cls = Qwen3MoeConfig if fields.pop("model_type") == "qwen3_moe" else Qwen3Config
    return cls(**fields)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flavor", list(HUB_CONFIGS))
def test_flavor_param_count_equals_transformers(flavor):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(_hf_config(HUB_CONFIGS[flavor]))
    hf_params = sum(p.numel() for p in hf.parameters())  # a tied head counts once
    spec = get_model_spec("qwen3")
    args = spec.flavors[flavor]
    with torch.device("meta"):
        ours = spec.model_cls(args)
    summary = spec.summary_fn(ours, args, 4096)
    assert summary["params"] == hf_params
    assert args.param_counts()[0] == hf_params
    if args.moe_enabled:
        per_expert = 3 * args.dim * args.moe_inter_dim
        assert summary["activated_params"] == hf_params - args.n_moe_layers * (128 - 8) * per_expert
    # The Hub config reads back as exactly this flavor (and names it).
    cfg = {**_COMMON, **HUB_CONFIGS[flavor]}
    adapter = spec.state_dict_adapter
    assert adapter.signature(adapter.args_from_hf(cfg)) == adapter.signature(args)


# --------------------------------------------------------------------------- folders


def build_hf_qwen3(folder: Path, *, moe: bool = False, tied: bool = False, legacy: bool = False, vocab: int = 256,
                   layers: int = 2, seed: int = 0, tokenizer: bool = False) -> Path:
    """A random tiny Qwen3 (or Qwen3-MoE) folder saved by transformers: GQA, head_dim 24 on a
    width of 64 (not 64 / 4), QK-norm; MoE: 8 experts, top 2, normalised, block 0 dense."""
    from transformers import AutoModelForCausalLM

    fields = {"model_type": "qwen3_moe" if moe else "qwen3", "vocab_size": vocab, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": tied}
    if moe:
        fields.update(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      mlp_only_layers=[0])
    cfg = _hf_config(fields)
    torch.manual_seed(seed)
    save_random_gqa_folder(AutoModelForCausalLM.from_config(cfg), folder, seed=seed, tied=tied, legacy=legacy)
    if tokenizer:
        build_qwen_tokenizer(folder, vocab)
    return folder


def build_qwen_tokenizer(folder: Path, vocab: int) -> Path:
    """A byte-level BPE tokenizer.json with Qwen's special tokens (<|endoftext|>, <|im_start|>,
    <|im_end|>) and a tokenizer_config.json as the Qwen3 base models have: no BOS, EOS and pad
    <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from trainer.data.builtin_corpus import builtin_documents

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - 8, special_tokens=list(QWEN_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(builtin_documents(max_files=40), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
         "tokenizer_class": "Qwen2Tokenizer"}))
    return folder


QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


CASES = {
    "dense_tied": dict(tied=True),
    "dense_untied_legacycfg": dict(legacy=True),
    "moe_untied": dict(moe=True),
    "moe_tied_legacycfg": dict(moe=True, tied=True, legacy=True),
}


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    return {name: build_hf_qwen3(root / name, **kw) for name, kw in CASES.items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_logits_parity_import_export(case, qwen_dirs, tmp_path):
    src = qwen_dirs[case]
    import transformers

    saved = json.loads((src / "config.json").read_text())
    if int(transformers.__version__.split(".")[0]) >= 5:  # both config.json spellings are covered
        assert ("rope_parameters" in saved) != case.endswith("legacycfg")
    assert saved["model_type"] == ("qwen3_moe" if case.startswith("moe") else "qwen3")
    tokens = tokens_for(256)
    ref = hf_logits(src, tokens)
    model = our_model_from_hf(src)
    assert (model.output.weight is model.tok_embeddings.weight) == ("_tied" in case)
    with torch.no_grad():
        ours = model(tokens)
    assert ref.std() > 0.5, "logits too flat to test anything"
    import_diff = (ours - ref).abs().max().item()
    if case.startswith("moe"):  # routing matters: every MoE layer spreads its tokens unevenly
        was_training = model.training
        model.train()  # expert loads are counted in training forwards only (validation must not feed the bias)
        with torch.no_grad():
            model(tokens)
        model.train(was_training)
        counts = torch.stack([b for n, b in model.named_buffers() if n.endswith("tokens_per_expert")])
        assert (counts > 0).sum() > counts.shape[0] * 4 and counts.float().std(dim=1).min() > 2

    out = tmp_path / "export"
    save_hf([model], out, dtype=torch.float32)
    back = hf_logits(out, tokens)
    export_diff = (back - ref).abs().max().item()
    print(f"\n{case}: import max|diff| {import_diff:.3g}, export->transformers max|diff| {export_diff:.3g}")
    assert import_diff < TOL and export_diff < TOL
    # The export is the exact inverse of the import: the same tensors, no lm_head when tied.
    orig, new = HFReader(src), HFReader(out)
    assert set(new.keys()) == set(orig.keys())
    for k in orig.keys():
        assert torch.equal(orig.full(k), new.full(k)), k
    exported = json.loads((out / "config.json").read_text())
    assert exported["model_type"] == saved["model_type"] and exported["tie_word_embeddings"] == ("_tied" in case)


def test_unsupported_model_type_is_one_line(qwen_dirs, tmp_path):
    folder = tmp_path / "next"
    folder.mkdir()
    cfg = json.loads((qwen_dirs["moe_untied"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_next"}))
    with pytest.raises(HFConfigError) as e:
        model_from_hf_folder(folder)
    msg = str(e.value)
    assert "\n" not in msg and "'qwen3_next' is not supported" in msg and "qwen3_moe" in msg
    # A field that changes the math is refused too, in one line (sliding-window attention).
    (folder / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True, "sliding_window": 64}))
    with pytest.raises(HFConfigError, match="use_sliding_window=true is not supported"):
        model_from_hf_folder(folder)


@pytest.mark.parametrize("flavor", ["debug", "debug_moe", "0.6B", "30B-A3B"])
def test_args_config_roundtrip(flavor):
    spec = get_model_spec("qwen3")
    adapter = spec.state_dict_adapter
    args = spec.flavors[flavor]
    back = adapter.args_from_hf(adapter(args).hf_config())
    assert adapter.signature(back) == adapter.signature(args)
    assert back.tie_embeddings == args.tie_embeddings


# --------------------------------------------------------------------------- activation checkpointing


def _tiny(moe: bool, **changes):
    import dataclasses

    from parallelisms.param_init import layout_independent_init

    spec = get_model_spec("qwen3")
    args = dataclasses.replace(spec.flavors["debug_moe" if moe else "debug"], dim=64, n_heads=4, n_kv_heads=2,
                               head_dim=24, ffn_hidden_dim=96, moe_inter_dim=32, n_layers=3, vocab_size=256,
                               max_seq_len=64, **changes)
    model = spec.model_cls(args)
    layout_independent_init([model], seed=0, buffer_device=torch.device("cpu"))
    return spec, model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("moe,changes", [(False, {}), (True, {}),
                                         (True, {"aux_loss_scope": "model", "aux_loss_coeff": 0.5})],
                         ids=["dense_tied", "moe", "moe_pooled_balance_loss"])
def test_every_ac_mode_is_bitwise_equal_to_none(moe, changes):
    """none / full / selective / op / budget (with this spec's MoE op policy) give the same
    losses and grads, bitwise in fp32, over 2 steps; the tied head stays one parameter. The
    balance loss pooled over the layers (its gradient computed in backward from the forward's
    counts) too: a recompute in backward adds no counts."""
    from tests.ac_helpers import assert_bitwise, run_mode

    spec, base = _tiny(moe, **changes)
    assert (base.output.weight is base.tok_embeddings.weight) == (not moe)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
               for _ in range(2)]
    ref = run_mode(base, "none", batches, spec=spec)
    for mode, cfg in (("full", {}), ("selective", {}), ("op", {}), ("budget", {"budget_fraction": 0.3})):
        assert_bitwise(ref, run_mode(base, mode, batches, spec=spec, cfg=cfg))


def test_batch_balance_loss_is_hf_switch_loss_over_top_k():
    """aux_loss_scope="batch" on one layer is transformers' Qwen3-MoE load-balancing loss
    (Switch: E * sum_i f_i P_i over every token of the batch) divided by top_k: our f_i is
    normalised so that a balanced router gives 1, HF's gives top_k."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from models.common.moe import MoE, MoEArgs

    torch.manual_seed(0)
    layer = MoE(16, 8, MoEArgs(num_experts=8, top_k=2, num_shared_experts=0, score_func="softmax",
                               route_norm=True, aux_loss_coeff=1.0, aux_loss_scope="batch"))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, 10, 16)
    layer.train()
    layer(x)
    logits = layer.router.gate(x.reshape(-1, 16))
    hf = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    # MoE's default normalisation is 1 / sequences of this forward, times bsz for "batch": one mean.
    assert torch.allclose(layer.aux_loss, hf / 2, rtol=1e-5, atol=0), (layer.aux_loss, hf)
    assert layer.aux_loss > 1.0  # this router is unbalanced: the loss sees it


def _with_router_loss(folder: Path, on: bool, coef: float = 0.02) -> Path:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(output_router_logits=on, router_aux_loss_coef=coef)
    path.write_text(json.dumps(cfg, indent=2))
    return folder


def test_imported_balance_loss_is_transformers_load_balancing_over_all_layers(tmp_path):
    """A transformers Qwen3-MoE (5 blocks: one dense, 4 MoE) with output_router_logits and
    router_aux_loss_coef 0.02 imports as aux_loss_scope "model", coefficient 0.02: one forward's
    balance loss equals 0.02 x transformers' own load_balancing_loss_func over the 4 layers'
    router logits, and so do the router gradients of every layer (rel 1e-5). The per-layer
    scope sums 4 losses, each 1 when balanced: 4 / top_k times HF's at equal loads, and other
    gradients. Exported, the coefficient reads back; output_router_logits false imports with
    no balance loss, and the trainer's log line says so."""
    from models.qwen3.state_dict_adapter import balance_note
    from tests.hf_builders import load_hf_model

    folder = _with_router_loss(build_hf_qwen3(tmp_path / "moe", moe=True, layers=5), True)
    tokens = tokens_for(256, shape=(2, 24))
    hf = load_hf_model(folder).train()
    out = hf(tokens, output_router_logits=True)
    (0.02 * out.aux_loss).backward()
    hf_grads = {i: hf.model.layers[i].mlp.gate.weight.grad for i in range(1, 5)}

    _, args = model_from_hf_folder(folder)
    assert (args.aux_loss_scope, args.aux_loss_coeff, args.n_moe_layers) == ("model", 0.02, 4)

    def ours(scope: str):
        model = our_model_from_hf(folder)
        moes = [layer.moe for layer in model.layers.values() if getattr(layer, "moe", None) is not None]
        for moe in moes:
            moe.args.aux_loss_scope = scope
        model.train()
        (model(tokens) * 0).sum().backward()  # only the balance loss reaches the routers
        loss = sum(moe.aux_loss for moe in moes)
        return loss, {i: model.layers[str(i)].moe.router.gate.weight.grad for i in range(1, 5)}

    loss, grads = ours("model")
    assert torch.allclose(loss, 0.02 * out.aux_loss.detach(), rtol=1e-5, atol=0), (loss, out.aux_loss)
    for i in range(1, 5):
        rel = (grads[i] - hf_grads[i]).norm() / hf_grads[i].norm()
        assert rel < 1e-5, (i, rel.item())
    per_layer, per_layer_grads = ours("batch")
    assert abs(per_layer / loss - 4 / 2) < 0.5  # about L / top_k x HF's, not equal
    assert max((per_layer_grads[i] - hf_grads[i]).norm() / hf_grads[i].norm() for i in range(1, 5)) > 0.1

    exported = get_model_spec("qwen3").state_dict_adapter(args).hf_config()
    assert exported["output_router_logits"] is True and exported["router_aux_loss_coef"] == 0.02
    assert "HF's load_balancing_loss_func, one loss over all 4 MoE layers, coefficient 0.02" in \
        balance_note(args, json.loads((folder / "config.json").read_text()))

    _with_router_loss(folder, False)  # as the released Qwen3-30B-A3B config.json has it
    _, off = model_from_hf_folder(folder)
    assert off.aux_loss_coeff == 0.0
    note = balance_note(off, json.loads((folder / "config.json").read_text()))
    assert note.startswith("MoE balancing: no balance loss (config.json: output_router_logits false") and \
        "--moe.aux_loss_coeff 0.001" in note and "\n" not in note


def test_pooled_balance_loss_under_torch_checkpoint_recompute():
    """torch's own checkpoint (which the AC modes fall back to) re-runs each block's forward in
    backward: the pooled loss's recompute must add no counts to any forward's pool, so the
    router gradients equal the run without checkpointing, bitwise (before the pool closed with
    its forward, a recompute counted its layer twice and the gradients moved)."""
    import copy

    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    spec, base = _tiny(True, aux_loss_scope="model", aux_loss_coeff=0.5)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))

    def router_grads(recompute: bool):
        model = copy.deepcopy(base).train()
        if recompute:
            for block in model.layers.values():
                block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(block.forward)
        for _ in range(2):  # the second forward's pool must not see the first's recompute either
            model.zero_grad()
            with set_checkpoint_early_stop(False):  # recompute the whole block (early stop ends before the loss)
                model(tokens).square().mean().backward()
        return [m.router.gate.weight.grad for m in model.modules() if hasattr(m, "router")]

    plain, recomputed = router_grads(False), router_grads(True)
    assert len(plain) == 2 and all(torch.equal(a, b) for a, b in zip(plain, recomputed))


@pytest.mark.timeout(300)
def test_pooled_balance_loss_compiled_blocks_equal_eager():
    """A MoE block under torch.compile: the pooled loss runs outside the compiled graph (its
    backward reads the forward's pool when it runs; traced, the router gradients were 2x off),
    so the router gradients equal eager's within 1e-6."""
    import copy

    spec, base = _tiny(True, aux_loss_scope="model", aux_loss_coeff=0.5)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))

    def router_grads(compiled: bool):
        model = copy.deepcopy(base).train()
        if compiled:
            model.layers["1"].compile()  # the first MoE block: its gradient needs the later block's picks
        model(tokens).square().mean().backward()
        return [m.router.gate.weight.grad for m in model.modules() if hasattr(m, "router")]

    eager, compiled = router_grads(False), router_grads(True)
    for a, b in zip(eager, compiled):
        assert (a - b).norm() <= 1e-6 * a.norm(), ((a - b).norm() / a.norm()).item()


def test_pooled_balance_loss_is_refused_under_pp_in_one_line():
    """Pipeline stages hold different layers and cannot pool their routing: one line naming the
    field and the fixes; the per-layer scope, or no loss, is accepted."""
    from configuration.fields import ConfigError
    from trainer.config import load_config

    pp = ["--model.name", "qwen3", "--model.flavor", "30B-A3B", "--parallelism.pipeline_parallel_degree", "2"]
    with pytest.raises(ConfigError, match=r"moe\.aux_loss_scope: 'model' pools") as e:
        load_config(pp)
    assert "\n" not in str(e.value) and "--moe.aux_loss_scope batch" in str(e.value)
    assert load_config(pp + ["--moe.aux_loss_scope", "batch"]).model_args.aux_loss_scope == "batch"
    assert load_config(pp + ["--moe.aux_loss_coeff", "0"]).model_args.aux_loss_coeff == 0
