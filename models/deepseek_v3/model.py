"""DeepSeek V3 in plain PyTorch: MLA attention with YaRN RoPE, dense SwiGLU then MoE blocks.

Same conventions as models/llama3: blocks in a `ModuleDict` keyed "0".."L-1",
`forward` tolerates a missing embedding / final norm / output head (pipeline
stages), `init_weights(buffer_device)` initialises everything including the
non-persistent rope cache.

RoPE layout: the rope part of q and k (the last `qk_rope_head_dim` channels of each
q head, and the last `qk_rope_head_dim` outputs of `wkv_a`) uses the rotate-half
layout of models/common/rope.py: channel j pairs with channel j + d/2. DeepSeek's
own / HF checkpoints use the interleaved layout (channel 2i pairs with 2i + 1); an HF
adapter must permute those output rows of wq (or wq_b) and wkv_a with
`[0, 2, 4, ..., d-2, 1, 3, ..., d-1]` (and the inverse on export). See
`interleaved_to_half_perm`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from models.common.attention import DocumentMask, SDPA
from models.common.block import MoETransformerBlock
from models.common.decoder import DecoderLM
from models.common.moe_pool import pooled_routing
from models.common.init import trunc_normal_
from models.common.moe import MoE, MoEArgs, inactive_expert_params
from models.common.norms import RMSNorm
from models.common.rope import apply_rope, rope_cos_sin
from models.deepseek_v3.args import DeepSeekV3Args
from models.deepseek_v3.mtp import MTPLayer, mtp_embedding_ids, pipeline_tensor


def interleaved_to_half_perm(rope_dim: int) -> torch.Tensor:
    """Index that reorders interleaved-rope channels into the rotate-half layout:
    `w_half = w_interleaved[perm]` on the rope output rows."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def yarn_inv_freq(dim: int, theta: float, factor: float, original_seq_len: int,
                  beta_fast: float, beta_slow: float) -> torch.Tensor:
    """RoPE inverse frequencies with YaRN ("NTK-by-parts") interpolation.

    Frequencies that turn more than `beta_fast` times over the original context keep
    their value, those that turn fewer than `beta_slow` times are divided by `factor`,
    and a linear ramp over the dimension index blends the two in between."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if factor <= 1.0:
        return inv_freq.float()

    def dim_for_rotations(n_rot: float) -> float:
        # Pair index i whose wavelength 2*pi*theta^(2i/dim) fits n_rot times into original_seq_len.
        return dim * math.log(original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(dim_for_rotations(beta_fast)), 0)
    hi = min(math.ceil(dim_for_rotations(beta_slow)), dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0.0, 1.0)
    # ramp 0 -> keep (extrapolate), ramp 1 -> interpolate (divide by factor).
    inv_freq = inv_freq / factor * ramp + inv_freq * (1.0 - ramp)
    return inv_freq.float()


class MLA(nn.Module):
    """Multi-head latent attention.

    q = wq(x) or wq_b(q_norm(wq_a(x)))              -> [.., H, nope + rope]
    wkv_a(x) = [c_kv (kv_lora_rank), k_rope (rope)]  (k_rope shared by all heads)
    wkv_b(kv_norm(c_kv))                             -> [.., H, nope + v]
    """

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.n_heads = args.n_heads
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.nope_dim = args.qk_nope_head_dim
        self.rope_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_head_dim
        self.v_head_dim = args.v_head_dim
        self.softmax_scale = args.softmax_scale
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, args.n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, args.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        # Identity hook point on the per-token latent [B, S, kv_lora_rank + rope] that every
        # head's k and v are expanded from: context parallelism gathers the sequence there
        # (576 values per token for V3, instead of the 40960 of the expanded k and v).
        self.kv_latent = nn.Identity()
        self.sdpa = SDPA(scale=self.softmax_scale)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 head counts: under TP these projections hold only the local heads.
        q = q.view(bsz, seqlen, -1, self.qk_head_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1)

        kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), rope).squeeze(2)  # [B, S, rope]
        latent = self.kv_latent(torch.cat([self.kv_norm(kv), k_rope], dim=-1))  # [B, S_kv, kv_lora_rank + rope]
        kv_len = latent.shape[1]  # S, or more keys than queries when kv_latent gathers them
        kv, k_rope = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(kv).view(bsz, kv_len, -1, self.nope_dim + self.v_head_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)], dim=-1)

        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.sdpa(q, k, v, mask=mask)  # [B, H, S, v_head_dim]
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_weights(self, out_std: float) -> None:
        lins = [self.wq] if self.q_lora_rank == 0 else [self.wq_a, self.wq_b]
        for lin in lins + [self.wkv_a, self.wkv_b]:
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=out_std)
        if self.q_lora_rank:
            self.q_norm.reset_parameters()
        self.kv_norm.reset_parameters()


def moe_args_from(args: DeepSeekV3Args) -> MoEArgs:
    return MoEArgs(
        num_experts=args.n_routed_experts, top_k=args.n_activated_experts,
        num_shared_experts=args.n_shared_experts, score_func=args.score_func, route_norm=args.route_norm,
        route_scale=args.route_scale, n_groups=args.n_expert_groups, topk_groups=args.n_limited_groups,
        aux_loss_coeff=args.aux_loss_coeff, aux_loss_scope=args.aux_loss_scope, use_grouped_mm=args.use_grouped_mm,
    )


class TransformerBlock(MoETransformerBlock):
    """Pre-norm MLA block: dense SwiGLU for the first `n_dense_layers`, MoE after (and in MTP modules)."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args):
        moe = moe_args_from(args) if layer_id >= args.n_dense_layers else None
        super().__init__(layer_id, args, MLA(args), moe, args.inter_dim)


class DeepSeekV3(DecoderLM):
    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args, TransformerBlock)
        # Multi-token prediction (models/deepseek_v3/mtp.py): after `output`, so the last pipeline stage holds it.
        self.mtp = nn.ModuleDict({
            str(k): MTPLayer(TransformerBlock(args.n_layers + k, args), args.dim, args.norm_eps)
            for k in range(args.mtp_depth)}) if args.mtp_depth > 0 else None

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        super().init_weights(buffer_device)
        for layer in (self.mtp.values() if self.mtp is not None else ()):
            layer.init_weights()

    def forward(self, tokens: torch.Tensor, *carried: torch.Tensor, positions: torch.Tensor | None = None,
                mtp_labels: torch.Tensor | None = None, document_ids: torch.Tensor | None = None):
        """As DecoderLM.forward; with MTP and `mtp_labels` (training), the logits of the main
        head and of every MTP depth, concatenated on the batch dim: [(1 + D) * B, S, V].

        Pipeline stages: the first embeds the MTP tokens with the inputs; every stage but
        the last returns (hidden, *MTP embeddings), and takes them as `tokens, *carried`."""
        depth = self.args.mtp_depth
        if depth == 0 or mtp_labels is None:
            return super().forward(tokens, positions, document_ids)
        if self.tok_embeddings is not None:
            # One embedding call for the inputs and the MTP tokens: [(1 + D) * B, S, dim].
            embedded = self.tok_embeddings(torch.cat([tokens, mtp_embedding_ids(mtp_labels, depth)], dim=0))
            h, *carried = embedded.split(tokens.shape[0], dim=0)
        else:
            h = tokens
        rope = self.rope_cache[: h.shape[1]] if positions is None else self.rope_cache[positions]
        mask = None if document_ids is None else DocumentMask(document_ids)
        with pooled_routing():  # the MTP layers' MoE too (models/common/moe_pool.py)
            for block in self.layers.values():
                h = block(h, rope, mask=mask)
            if self.output is None:
                return (h, *(pipeline_tensor(c) for c in carried))
            hidden = [self.norm(h)]
            for layer, emb in zip(self.mtp.values(), carried):
                hidden.append(layer(hidden[-1], emb, rope, mask=mask))
        return self.output(torch.cat(hidden, dim=0))

    def _rope_cache(self) -> torch.Tensor:
        a = self.args
        factor = a.rope_factor if a.yarn_enabled else 1.0
        inv_freq = yarn_inv_freq(a.qk_rope_head_dim, a.rope_theta, factor, a.original_seq_len,
                                 a.beta_fast, a.beta_slow)
        # YaRN's temperature is applied once, through the softmax scale (mscale^2), not here.
        return rope_cos_sin(inv_freq, a.max_seq_len)


def count_params(model_or_args: nn.Module | DeepSeekV3Args) -> tuple[int, int]:
    """(total, activated per token) parameters of an unsharded model, counting the
    embedding, the output head and the `expert_bias` buffers. Args are built on the
    meta device. Under EP, count the meta model, not a sharded one."""
    if isinstance(model_or_args, DeepSeekV3Args):
        with torch.device("meta"):
            model = DeepSeekV3(model_or_args)
    else:
        model = model_or_args
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.expert_bias.numel() for m in model.modules() if isinstance(m, MoE))
    return total, total - inactive_expert_params(model)
