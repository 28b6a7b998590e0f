"""Llama 3: the spec the trainer sees."""

from models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from models.llama3.model import Llama3
from models.spec import ModelSpec

spec = ModelSpec(name="llama3", flavors=LLAMA3_FLAVORS, model_cls=Llama3)

__all__ = ["spec", "Llama3", "Llama3Args", "LLAMA3_FLAVORS"]
