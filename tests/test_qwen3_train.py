"""`./run_train.sh --model.hf_path DIR` on Qwen3 and Qwen3-MoE folders, under every layout.

Three folders built by transformers (tests/test_qwen3_models.py), each with a Qwen-style
tokenizer.json (no BOS, <|endoftext|> as EOS): dense with a tied head (current config.json
spelling), dense untied, and MoE untied (legacy spelling). One command per layout trains
from a folder with no flavor: 1 rank, FSDP 2 and TP 2 on the tied folder (the tie is one
parameter in both), PP 2 and CP 2 (both methods) on the untied one, EP 2 on the MoE one.
Every run checks, as tests/test_hf_train.py does for Llama and DeepSeek:

* the first loss equals transformers' loss on the same global batch within 1e-5;
* at lr 0 `checkpoint.last_save_in_hf` exports the source tensors bit for bit (a tied
  folder has no lm_head, and the export writes none).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_hf_train import LOSS_TOL, VOCAB, _hf_loss, assert_export_is_the_source, train_one_step_at_lr0


@pytest.fixture(scope="module")
def qwen_folders(tmp_path_factory):
    import transformers  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)
    import tokenizers  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)
    from tests.test_qwen3_models import build_hf_qwen3

    root = tmp_path_factory.mktemp("qwen3_train")
    folders = {"tied": build_hf_qwen3(root / "tied", tied=True, vocab=VOCAB, layers=3, tokenizer=True),
               "dense": build_hf_qwen3(root / "dense", vocab=VOCAB, layers=3, tokenizer=True, seed=1),
               "moe": build_hf_qwen3(root / "moe", moe=True, vocab=VOCAB, layers=3, tokenizer=True, legacy=True,
                                     seed=2)}
    assert "rope_parameters" not in json.loads((folders["moe"] / "config.json").read_text())
    return folders


_REF: dict[str, float] = {}


def _ref_loss(folder) -> float:
    if str(folder) not in _REF:
        _REF[str(folder)] = _hf_loss(folder)
    return _REF[str(folder)]


LAYOUTS = {  # name -> (folder, ranks, extra CLI args); every one has a global batch of 4
    "tied_1rank": ("tied", 1, ["--training.local_batch_size", "4"]),
    "tied_fsdp2": ("tied", 2, ["--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "2"]),
    "tied_tp2": ("tied", 2, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    "dense_pp2": ("dense", 2, ["--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2"]),
    "dense_cp2_allgather": ("dense", 2, ["--training.local_batch_size", "4", "--parallelism.context_parallel_degree",
                                         "2", "--parallelism.context_parallel_method", "allgather"]),
    "dense_cp2_alltoall": ("dense", 2, ["--training.local_batch_size", "4", "--parallelism.context_parallel_degree",
                                        "2", "--parallelism.context_parallel_method", "alltoall"]),
    # Routed experts sharded over EP (borrowing the 2 FSDP ranks).
    "moe_ep2": ("moe", 2, ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2"]),
}


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qwen3_trains_from_hf_folder(layout, qwen_folders, tmp_path):
    name, ranks, extra = LAYOUTS[layout]
    folder = qwen_folders[name]
    dump = tmp_path / "dump"
    first = train_one_step_at_lr0(ranks, folder, dump, extra)
    ref = _ref_loss(folder)
    print(f"\n{layout}: first loss {first:.7f}, transformers {ref:.7f}, |diff| {abs(first - ref):.2g}")
    assert abs(first - ref) < LOSS_TOL, (first, ref)
    assert_export_is_the_source(folder, dump / "checkpoint" / "step-1-hf")
    assert json.loads((dump / "checkpoint" / "step-1-hf" / "config.json").read_text())["tie_word_embeddings"] == (
        name == "tied")
