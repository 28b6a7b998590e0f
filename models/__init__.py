"""Model registry: an explicit map from `model.name` to its `ModelSpec`.

Adding a model: create `models/<name>/` exporting `spec`, then add one line here.
"""

from models import llama3
from models.spec import ModelSpec

MODEL_SPECS: dict[str, ModelSpec] = {
    llama3.spec.name: llama3.spec,
    "deepseek_v3": __import__("models.deepseek_v3", fromlist=["spec"]).spec,
}


def get_model_spec(name: str) -> ModelSpec:
    return MODEL_SPECS[name]
