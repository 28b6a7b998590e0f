"""What one token costs a model, read from the model the trainer builds (on the meta device).

Why from the built model and not from formulas per architecture: the step-time model must
cover every model the project has (Llama, DeepSeek V3 with MLA and MoE, Qwen3) and any new
one, the way the memory estimator does. So the parameter classes are read from the meta
model's parameters by shape and name: 2-D weights in blocks are dense matmuls, 3-D expert
weights are grouped GEMMs (a token visits `n_activated_experts` of them), 1-D are norms.
The attention term comes from the model's own `flops_per_token` (linear in seq_len).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class Workload:
    name: str
    n_layers: int
    dim: int
    vocab: int
    ffn_hidden: int  # the widest hidden size of a block's MLP (elementwise traffic of SwiGLU)
    layer_dense: list  # per block: 2-D weight elements (attention, dense MLP, shared experts, router)
    layer_experts: list  # per block: routed experts' elements, all experts
    layer_active_experts: list  # per block: routed experts' elements a token visits
    layer_norms: list  # per block: 1-D elements
    embedding: int
    head: int  # output projection elements
    attention_fwd_per_token_per_seq: float  # forward attention FLOPs per token per key (non-causal), all layers
    kv_width: int  # K and V elements per token per layer that CP's all-gather moves (MLA: its latent)
    qkvo_width: int  # q, k, v and out elements per token per layer that Ulysses' all-to-alls move
    n_heads: int
    moe_layers: int
    top_k: int
    flops_per_token: callable = field(repr=False, default=None)  # model convention, for MFU
    other_params: int = 0  # outside the blocks, embedding and head (the final norm)
    tied_head: bool = False  # the head is the embedding's weight (counted once in total_params)
    # A block pass's eager dispatch against the calibration's debug Llama block (CPU entries:
    # measured per model by `workload_of(cfg, hw)`; 1 elsewhere, where dispatch is not modelled).
    block_dispatch_weight: float = 1.0
    # per block: the 2-D weights float8 converts (every block Linear but the router gate:
    # parallelisms/float8.py's default filter_fqns) and MLA's K/V up-projection (wkv_b), which
    # CP's all-gather runs on the whole gathered sequence
    layer_float8: list = field(default_factory=list)
    layer_float8_io: list = field(default_factory=list)  # per block: (sum of in, sum of out features)
    layer_kv_up: list = field(default_factory=list)
    kv_heads: int = 0  # K/V heads (GQA), for Ulysses' repeat; 0: as many as q heads

    @property
    def total_params(self) -> int:
        return (sum(self.layer_dense) + sum(self.layer_experts) + sum(self.layer_norms) + self.embedding
                + (0 if self.tied_head else self.head) + self.other_params)

    def matmul_flops_per_token(self, layers) -> float:
        """fwd+bwd (6 x elements) dense matmul FLOPs of the given blocks per token."""
        return 6.0 * sum(self.layer_dense[i] for i in layers)

    def grouped_flops_per_token(self, layers) -> float:
        return 6.0 * sum(self.layer_active_experts[i] for i in layers)

    def attention_flops_per_token(self, layers, seq_len: int, causal: bool = True) -> float:
        """fwd+bwd (3 x forward) attention FLOPs per token of the given blocks."""
        per_layer = self.attention_fwd_per_token_per_seq / self.n_layers
        return 3.0 * per_layer * len(list(layers)) * seq_len * (0.5 if causal else 1.0)


_CACHE: dict = {}


def workload_of(cfg, hw=None) -> Workload:
    """The `Workload` of a loaded config's model (cached per model args). With a CPU entry `hw`
    that models eager dispatch, its block pass is measured against the calibration block's."""
    key = (cfg.model_spec.name, repr(cfg.model_args))
    if key not in _CACHE:
        _CACHE[key] = _build(cfg)
    w = _CACHE[key]
    if hw is not None and hw.device == "cpu" and hw.efficiency.block_overhead_s > 0:
        from planner.calibrate import block_dispatch_weight

        w = replace(w, block_dispatch_weight=block_dispatch_weight(cfg))
    return w


def _build(cfg) -> Workload:
    from parallelisms.apply import build_model
    from trainer.model_args import model_label

    args = cfg.model_args
    model = build_model(cfg.model_spec, args)
    n_layers = len(model.layers)
    ids = {k: i for i, k in enumerate(model.layers.keys())}
    dense, experts, norms = [0] * n_layers, [0] * n_layers, [0] * n_layers
    float8, kv_up, float8_io = [0] * n_layers, [0] * n_layers, [(0, 0)] * n_layers
    embedding = head = other = 0
    ffn = 0
    emb_module, out_module = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    tied = emb_module is not None and out_module is not None and out_module.weight is emb_module.weight
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            i = ids[name.split(".")[1]]
            if p.dim() == 3:
                experts[i] += p.numel()
            elif p.dim() == 2:
                dense[i] += p.numel()
                if not name.endswith("router.gate.weight"):  # Linear weight [out, in]
                    float8[i] += p.numel()
                    float8_io[i] = (float8_io[i][0] + p.shape[1], float8_io[i][1] + p.shape[0])
                kv_up[i] += p.numel() if name.endswith("attention.wkv_b.weight") else 0
                if name.endswith(("w1.weight", "w3.weight")):
                    ffn = max(ffn, p.shape[0])
            else:
                norms[i] += p.numel()
        elif name.startswith("tok_embeddings"):
            embedding += p.numel()
        elif name.startswith("output"):
            head += p.numel()
        else:
            other += p.numel()
    if tied:  # named_parameters lists the shared weight once, under the embedding
        head = emb_module.weight.numel()
    n_routed = getattr(args, "n_routed_experts", 0) or 0
    top_k = getattr(args, "n_activated_experts", 0) or 0
    active = [e * top_k // n_routed if n_routed else 0 for e in experts]
    for i, e in enumerate(experts):  # an expert's w1/w3 width is the MLP width of a routed token
        if e and n_routed:
            ffn = max(ffn, getattr(args, "moe_inter_dim", 0) * top_k)
    fpt = args.flops_per_token
    n_params = sum(p.numel() for p in model.parameters())
    attn = (fpt(2, n_params, embedding) - fpt(1, n_params, embedding)) / 3.0  # forward, per key
    dim, n_heads = args.dim, args.n_heads
    if hasattr(args, "kv_lora_rank"):  # MLA: CP gathers the latent (kv_latent); q, k, v, o per head
        head_qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        kv_width = args.kv_lora_rank + args.qk_rope_head_dim
        qkvo = n_heads * (2 * head_qk + 2 * args.v_head_dim)
    else:
        head_dim = getattr(args, "head_dim", None) or dim // n_heads
        n_kv = getattr(args, "n_kv_heads", None) or n_heads
        kv_width = 2 * n_kv * head_dim
        qkvo = 2 * n_heads * head_dim + kv_width
    return Workload(name=model_label(cfg), n_layers=n_layers, dim=dim, vocab=args.vocab_size, ffn_hidden=ffn,
                    layer_dense=dense, layer_experts=experts, layer_active_experts=active, layer_norms=norms,
                    embedding=embedding, head=head, attention_fwd_per_token_per_seq=attn, kv_width=kv_width,
                    qkvo_width=qkvo, n_heads=n_heads, moe_layers=sum(1 for e in experts if e), top_k=top_k,
                    flops_per_token=lambda s, fpt=fpt, n=n_params, e=embedding: float(fpt(s, n, e)), tied_head=tied,
                    other_params=other, layer_float8=float8, layer_float8_io=float8_io, layer_kv_up=kv_up,
                    kv_heads=0 if hasattr(args, "kv_lora_rank") else (getattr(args, "n_kv_heads", None) or n_heads))
