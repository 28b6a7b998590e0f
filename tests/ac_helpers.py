"""Helpers shared by the activation-checkpointing tests (test_activation_checkpoint, test_ac_*,
test_qwen3_models): small seeded models, a few AdamW steps that record the loss and every
gradient, and the bitwise comparison every AC mode must pass against `none`."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

from parallelisms.activation_checkpoint import ActivationCheckpointConfig, apply_activation_checkpointing


def clean_name(name: str) -> str:
    return name.replace(_CHECKPOINT_PREFIX, "")


def train_steps(model, batches, steps=2):
    """Loss and every parameter grad (keyed without wrapper prefixes) for each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    record = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        inputs, target = batches[step]
        out = model(inputs)
        loss = F.cross_entropy(out.flatten(0, -2), target.flatten()) if target.dtype == torch.long \
            else F.mse_loss(out, target)
        loss.backward()
        record.append((loss.detach().clone(), {clean_name(n): p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return record


def assert_bitwise(ref, got):
    assert len(ref) == len(got)
    for (l_ref, g_ref), (l_got, g_got) in zip(ref, got):
        assert torch.equal(l_ref, l_got), (l_ref.item(), l_got.item())
        assert g_ref.keys() == g_got.keys()
        for name in g_ref:
            assert torch.equal(g_ref[name], g_got[name]), name


def run_mode(base, mode, batches, **kwargs):
    model = copy.deepcopy(base)
    cfg = ActivationCheckpointConfig(mode=mode, **kwargs.pop("cfg", {}))
    apply_activation_checkpointing(model, cfg, **kwargs)
    torch.manual_seed(1234)  # same RNG stream for dropout in every mode
    return train_steps(model, batches)


def tiny_deepseek():
    from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3
    args = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debug"], dim=64, n_layers=2, n_dense_layers=1, inter_dim=128,
                               moe_inter_dim=32, n_heads=4, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
                               qk_rope_head_dim=8, v_head_dim=16, vocab_size=256, max_seq_len=64)
    torch.manual_seed(0)
    model = DeepSeekV3(args)
    model.init_weights()
    return model


def block_inputs(model, batch=2, seq=16):
    torch.manual_seed(5)
    x = torch.randn(batch, seq, model.args.dim, requires_grad=True)
    return x, model.rope_cache[:seq]


def seeded_llama(flavor: str = "debug_small", seed: int = 0, **overrides):
    """A Llama 3 of `flavor` (args overridden by `overrides`), initialised under `seed`, on the CPU."""
    from models.llama3 import LLAMA3_FLAVORS, Llama3

    torch.manual_seed(seed)
    model = Llama3(dataclasses.replace(LLAMA3_FLAVORS[flavor], **overrides))
    model.init_weights()
    return model


def token_batches(steps: int, vocab: int = 2048, shape=(2, 16), seed: int = 5) -> list:
    """`steps` seeded (tokens, targets) pairs."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
            for _ in range(steps)]


def train_against_none(base, mode: str, batches, *, before=None, after_forward=None, after_backward=None):
    """Trains a copy of `base` under `none` and one under `mode` (no optimizer step: gradients
    only) and asserts every step's loss and gradients equal bitwise. `before`, `after_forward`
    and `after_backward` run around each step of both runs. Returns (the policy, the model) of
    the `mode` run."""
    runs = {}
    for run in ("none", mode):
        model = copy.deepcopy(base)
        policy = apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=run))
        runs[run] = []
        for tokens, target in batches:
            model.zero_grad(set_to_none=True)
            if before:
                before()
            loss = F.cross_entropy(model(tokens).flatten(0, -2), target.flatten())
            if after_forward:
                after_forward()
            loss.backward()
            if after_backward:
                after_backward()
            runs[run].append((loss.detach(), {clean_name(n): p.grad.clone() for n, p in model.named_parameters()}))
    assert len(runs["none"]) == len(runs[mode]) == len(batches)
    for (loss_ref, grads_ref), (loss, grads) in zip(runs["none"], runs[mode]):
        assert grads_ref.keys() == grads.keys()
        assert torch.equal(loss_ref, loss) and all(torch.equal(grads_ref[n], grads[n]) for n in grads_ref)
    return policy, model


def count_direct_paths(set_attr=setattr, held: list | None = None):
    """A Counter bumped by each rebuild of a direct recompute ("rebuilds") and each block that
    torch's checkpoint re-runs ("reruns"), through patches made with `set_attr` (a test's
    `monkeypatch.setattr`, or plain setattr in a worker). With `held`, each direct call whose
    forward ended appends the tensors it holds then (its packs and the arguments it took)."""
    import collections

    from torch.utils import checkpoint as torch_checkpoint

    from parallelisms.ac_direct import _DirectCall

    count = collections.Counter()
    rebuild, rerun, exit_ = _DirectCall._rebuild, torch_checkpoint._run_fn_with_dynamo_disabled, _DirectCall.__exit__

    def counted_rebuild(self):
        count["rebuilds"] += 1
        return rebuild(self)

    def counted_rerun(fn, *args):
        count["reruns"] += 1
        return rerun(fn, *args)

    def noted_exit(self, *exc):
        slots = self.slots
        out = exit_(self, *exc)
        held.append([s.x for s in slots if s.x is not None] + [x for x, _ in (self.args or {}).values()])
        return out

    set_attr(_DirectCall, "_rebuild", counted_rebuild)
    set_attr(torch_checkpoint, "_run_fn_with_dynamo_disabled", counted_rerun)
    if held is not None:
        set_attr(_DirectCall, "__exit__", noted_exit)
    return count
