"""Hugging Face models loaded from a `save_pretrained` directory, under every strategy.

A tiny Llama (and GPT-2, tied embeddings) built here is loaded with its parameters on the meta
device and filled from its safetensors ([Note: parameters on the meta device] in models/hf.py):
all at once before DDP / ZeRO-1/2, unit by unit under ZeRO-3. 2 ranks train 3 AdamW steps with
clipping that bites on their halves of a global batch, against one process running
`AutoModelForCausalLM.from_pretrained` on the whole batch; the same with peft LoRA (the base
stays bit-identical, frozen parameters hold no gradient or optimizer state).
"""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import make_tiny_llama
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.models.hf import HFSource
from dataparallel.models.lora import LoraSpec, merged_state_dict
from dataparallel.strategies.zero3.plan import MIN_UNIT_PARAMS, plan_units

from .harness import run_world

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
LORA = LoraSpec(r=4, alpha=8.0, targets=("q_proj", "v_proj"))
STEPS, CLIP = 3, 0.05


def _batches(vocab: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (4, 17), generator=g) for _ in range(STEPS)]


def _loss(model, rows):
    logits = model(rows[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())


def _train(model, optimizer, batches, part, clip):
    norms = []
    for rows in batches:
        _loss(model, rows[part]).backward()
        norms.append(float(clip(model)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def _build(path, strategy, lora):
    """The model from `path`, parallelized with its parameters filled as the strategy needs."""
    source = HFSource.open(path)
    model = source.build(lora=lora)
    fill = source.materializer(model)
    sizes = []
    if strategy == "zero3":
        units = plan_units(model, None, MIN_UNIT_PARAMS)
        planned = sorted(sum(p.numel() for p in u.params) for u in units)

        def counted(params):
            sizes.append(sum(p.numel() for p in params))
            fill(params)

        dp.parallelize(model, dp.ZeRO3(materialize=counted))
        assert sorted(sizes) == planned, (sizes, planned)  # one call per unit, its parameters
    else:
        fill(list(model.parameters()))
        dp.parallelize(model, strategy)
    return model, sizes


def _world(world, path, lora):
    from transformers import AutoModelForCausalLM

    out = {}
    half = slice(2 * world.rank, 2 * world.rank + 2)
    for strategy in STRATEGIES:
        model, sizes = _build(path, strategy, lora)
        start = dp.full_state_dict(model)
        batches = _batches(model.config.vocab_size)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = dp.build_optimizer(model, torch.optim.AdamW, params=params, lr=1e-3)
        norms = _train(model, optimizer, batches, half, lambda m: dp.clip_grad_norm_(m, CLIP))
        report = dp.memory_report(model, optimizer)
        full = dp.full_state_dict(model)
        # One process, the whole batch, the library's own loading.
        reference = AutoModelForCausalLM.from_pretrained(path).train()
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.targets))
            reference = get_peft_model(reference, config)
            # Both start from the adapters ours drew (on rank 0, broadcast).
            with torch.no_grad():
                for name, p in reference.named_parameters():
                    if "lora_" in name:
                        p.copy_(start[name])
        ref_params = [p for p in reference.parameters() if p.requires_grad]
        ref_opt = torch.optim.AdamW(ref_params, lr=1e-3)
        ref_norms = _train(
            reference,
            ref_opt,
            batches,
            slice(None),
            lambda m: torch.nn.utils.clip_grad_norm_(
                [p for p in m.parameters() if p.requires_grad], CLIP
            ),
        )
        theirs = reference.state_dict()
        out[strategy] = {
            "diff": max((full[k] - theirs[k]).abs().max().item() for k in theirs),
            "names": sorted(set(full) ^ set(theirs)),
            "norms": (norms, ref_norms),
            "sizes": (max(sizes) if sizes else 0, sum(p.numel() for p in model.parameters())),
            "trainable": sum(p.numel() for p in params),
            "report": report,
            "merged": sorted(merged_state_dict(full, lora)) if lora else [],
            "base_moved": max(
                ((full[k] - start[k]).abs().max().item() for k in full if "lora_" not in k),
                default=0.0,
            ),
        }
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("hf") / "llama", layers=3, width=64)


def test_a_llama_from_its_directory_matches_one_process_under_every_strategy(llama):
    results = run_world(2, _world, llama, None)
    for rank, out in enumerate(results):
        assert list(out) == STRATEGIES, list(out)
        for strategy, r in out.items():
            assert r["names"] == [], (strategy, r["names"])
            assert r["diff"] < 2e-5, (rank, strategy, r["diff"])
            ours, theirs = r["norms"]
            assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4
            assert min(ours) > CLIP  # the clipping bit at every step
    biggest, total = results[0]["zero3"]["sizes"]
    # ZeRO-3 filled the model unit by unit (each call one planned unit's parameters, checked
    # in `_build`): the root, then the two small layers as one unit (min_unit_params' default
    # groups them), each less than the whole model
    assert 0 < biggest < total, (biggest, total)


def test_lora_trains_only_the_adapters_under_every_strategy(llama):
    """peft LoRA on q and v: parity with one process running peft, the base bit-identical,
    and no gradient or optimizer state for the frozen base on any strategy."""
    from safetensors.torch import load_file

    results = run_world(2, _world, llama, LORA)
    base_names = sorted(load_file(llama / "model.safetensors"))
    for rank, out in enumerate(results):
        assert list(out) == STRATEGIES, list(out)
        for strategy, r in out.items():
            assert r["names"] == [], (strategy, r["names"])
            assert r["diff"] < 2e-5, (rank, strategy, r["diff"])
            assert r["base_moved"] == 0.0, strategy
            assert r["merged"] == base_names  # the export's names are the base model's
            # q (64 x 64) and v (64 x 32) in 3 layers, rank 4: A is 4 x 64, B is out x 4.
            assert r["trainable"] == 3 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4), r["trainable"]
            shards = 1 if strategy == "ddp" else 2
            grads, state = r["report"]["grads"], r["report"]["optimizer_state"]
            # fp32 gradients of the adapters alone (ZeRO-2/3 keep their shard; DDP and ZeRO-1 the
            # whole bucket), and AdamW's two moments of this rank's share (padding aside).
            full_grads = r["trainable"] * 4
            assert grads <= full_grads + 64, (strategy, grads)
            assert (
                2 * r["trainable"] * 4 // shards <= state <= 2 * r["trainable"] * 4 // shards + 256
            )
