"""Llama 3: the spec the trainer sees."""

from models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from models.llama3.model import Llama3
from models.llama3.state_dict_adapter import Llama3StateDictAdapter
from models.llama3.parallelize import parallelize_llama
from models.spec import ModelSpec



def summarize(model, args: Llama3Args, seq_len: int) -> dict[str, float]:
    params = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel() if model.tok_embeddings is not None else 0
    return {"params": params, "flops_per_token": args.flops_per_token(seq_len, params, embedding)}


spec = ModelSpec(name="llama3", flavors=LLAMA3_FLAVORS, model_cls=Llama3, summary_fn=summarize,
                 tensor_parallel_fn=parallelize_llama, state_dict_adapter=Llama3StateDictAdapter)

__all__ = ["spec", "Llama3", "Llama3Args", "LLAMA3_FLAVORS"]
