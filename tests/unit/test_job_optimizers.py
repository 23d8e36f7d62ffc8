"""The job's optimizers (train/optimizers.py, [Note: the job's optimizers]): which parameters
Muon steps for the built-in GPT (tied and untied head), tiny Hugging Face models and LoRA, the groups
and arguments each choice hands dp.compose, and the one-line error for an unknown name."""

from __future__ import annotations

import pytest
import torch

from dataparallel.models import build_model
from dataparallel.train.checks import check_values
from dataparallel.train.config import ConfigError, OptimConfig, RunConfig
from dataparallel.train.optimizers import choose_optimizer, muon_names

HIDDEN = ["attn.q", "attn.k", "attn.v", "attn.proj", "mlp.0", "mlp.2"]


@pytest.mark.parametrize("tied", [True, False])
def test_muon_steps_the_gpts_block_matrices_only(tied):
    model = build_model("gpt-tiny", tie_weights=tied)
    expected = [f"blocks.{b}.{m}.weight" for b in range(4) for m in HIDDEN]
    assert muon_names(model) == expected  # 24: neither tok_emb, pos_emb nor head
    assert ("head.weight" in dict(model.named_parameters())) is not tied


def test_the_mlps_last_layer_onto_the_vocabulary_is_its_head():
    model = build_model("mlp")
    assert muon_names(model) == ["net.1.weight", "net.3.weight"]  # not net.0 (256 x d), net.5


def test_muon_steps_the_hidden_matrices_of_hf_models(tmp_path):
    pytest.importorskip("transformers")
    from hf_fixtures import make_tiny_gpt2, make_tiny_llama
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "l", layers=2))
    projections = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    projections += ["self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    expected = [f"model.layers.{i}.{m}.weight" for i in range(2) for m in projections]
    assert muon_names(llama) == expected  # 14: not embed_tokens, not the untied lm_head
    gpt2 = AutoModelForCausalLM.from_pretrained(make_tiny_gpt2(tmp_path / "g", layers=2))
    blocks = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    expected = [f"transformer.h.{i}.{m}.weight" for i in range(2) for m in blocks]
    assert muon_names(gpt2) == expected  # 8: not wte (tied to lm_head), not wpe


def test_under_lora_muon_steps_the_adapters_of_hidden_matrices(tmp_path):
    pytest.importorskip("peft")
    from hf_fixtures import make_tiny_llama
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "l", layers=1))
    targets = ["q_proj", "v_proj", "lm_head"]
    model = get_peft_model(llama, LoraConfig(r=4, target_modules=targets))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 6  # A and B of each target
    layer = "base_model.model.model.layers.0.self_attn"
    expected = [f"{layer}.{m}.lora_{x}.default.weight" for m in ("q_proj", "v_proj") for x in "AB"]
    assert muon_names(model) == expected  # the head's adapters stay on AdamW


def test_each_choice_hands_compose_its_groups_and_arguments():
    model = build_model("gpt-tiny")
    params = list(model.parameters())
    counts = (sum(p.dim() >= 2 for p in params), sum(p.dim() < 2 for p in params))
    assert counts == (26, 42)
    adamw = choose_optimizer(OptimConfig(), model, 1e-3)
    assert adamw.cls is torch.optim.AdamW
    assert [len(g["params"]) for g in adamw.groups] == [26, 42]
    assert [g["weight_decay"] for g in adamw.groups] == [0.1, 0.0]
    # [Note: the job's AdamW kernel]: fused on the CPU, torch's own default elsewhere
    assert adamw.kwargs == {"lr": 1e-3, "betas": (0.9, 0.95), "fused": True}
    meta = choose_optimizer(OptimConfig(), model.to("meta"), 1e-3)
    assert meta.kwargs == {"lr": 1e-3, "betas": (0.9, 0.95)}
    model = build_model("gpt-tiny")
    factor = choose_optimizer(OptimConfig(optimizer="adafactor"), model, 1e-3)
    assert factor.cls is torch.optim.Adafactor and factor.kwargs == {"lr": 1e-3}
    assert [len(g["params"]) for g in factor.groups] == [26, 42]
    muon = choose_optimizer(OptimConfig(optimizer="muon", weight_decay=0.05), model, 1e-3)
    assert muon.cls is torch.optim.Muon
    assert muon.kwargs == {"lr": 1e-3, "weight_decay": 0.05, "adjust_lr_fn": "match_rms_adamw"}
    # Muon's 24 block matrices; AdamW's 2 embeddings (decayed) and 42 norms and biases.
    assert [len(g["params"]) for g in muon.groups] == [24, 2, 42]
    assert [g.get("optimizer") for g in muon.groups] == [None, torch.optim.AdamW, torch.optim.AdamW]
    assert [g.get("weight_decay") for g in muon.groups] == [None, 0.05, 0.0]
    assert muon.groups[1]["betas"] == (0.9, 0.95)
    assert [g.get("fused") for g in muon.groups] == [None, True, True]


def test_muon_without_a_hidden_matrix_is_one_line_naming_the_flag():
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.LayerNorm(4))
    with pytest.raises(ValueError, match=r"^--optimizer \(optim.optimizer\): muon finds no hidden"):
        choose_optimizer(OptimConfig(optimizer="muon"), model, 1e-3)


def test_an_unknown_optimizer_is_one_line_naming_the_flag():
    with pytest.raises(ConfigError) as error:
        check_values(RunConfig().replace(optim={"optimizer": "lion"}))
    assert str(error.value) == (
        "--optimizer (optim.optimizer): unknown value 'lion'; choose one of adamw, muon, adafactor"
    )
