"""Activation checkpointing on every strategy, against one process on the global batch without
it: `dp.checkpoint_activations` (each block's forward recomputed, [Note: checkpoint inside the
unit]) and a user's own `checkpoint(block, x, use_reentrant=False)` around whole blocks, which
under ZeRO-3 recomputes whole units, hooks included ([Note: recomputed forward] in
strategies/zero3/strategy.py). 4 steps, 2 ranks (4 for HSDP), AdamW, SGD and Adafactor; a tiny Llama
and LoRA through transformers' own switch. Reentrant checkpointing of a ZeRO-3 unit is refused
in one line.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from hf_fixtures import make_tiny_llama
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.activation_checkpointing import is_checkpointed

from .harness import RankError, run_world
from .models import (
    accumulate,
    OPTIMIZERS,
    batch,
    build,
    loss_fn,
    max_state_diff,
    reference_loss,
    train_chunks,
    user_checkpointed,
)

STEPS, PER_RANK = 4, 2
OPTIMIZERS = {**OPTIMIZERS, "adafactor": (torch.optim.Adafactor, {"lr": 1e-2})}


def count_block_forwards(model) -> list[int]:
    """A counter of the blocks' MLP forwards: one per block and step, two when recomputed (a
    pre-forward hook: the recompute stops once it has what backward needs, before the MLP's
    post-forward hooks)."""
    calls = [0]
    for block in model.blocks:
        block.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def gpt_case(world, strategy, how, opt_name="adamw", mesh=None, accum=1, early_stop=True):
    """max |ours - one process without checkpointing| over every weight after STEPS steps, and
    the block forwards per step."""
    rank, n = world.rank, world.world_size
    cls, kwargs = OPTIMIZERS[opt_name]
    model = build("transformer", seed=100 + rank)  # rank 0's weights win
    if how == "transform":
        dp.checkpoint_activations(model)
    elif how == "whole":
        user_checkpointed(model)
    calls = count_block_forwards(model)
    model = dp.parallelize(model, strategy, mesh=mesh)
    opt = dp.build_optimizer(model, cls, **kwargs)
    reference = build("transformer", seed=100)
    ref_opt = cls(reference.parameters(), **kwargs)
    for step in range(STEPS):
        x, y = batch("transformer", step, PER_RANK * n * accum)
        reference_loss("transformer", reference, x, y, step, n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        xs, ys = x.chunk(n)[rank].chunk(accum), y.chunk(n)[rank].chunk(accum)
        with torch_checkpoint.set_checkpoint_early_stop(early_stop):
            accumulate(
                model, lambda m: loss_fn("transformer", model, xs[m], ys[m], step, rank), accum
            )
        opt.step()
        opt.zero_grad()
    state = dp.full_state_dict(model)
    diff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return diff, calls[0] / (STEPS * accum * len(model.blocks))


def bf16_case(world, how) -> float:
    """ZeRO-3 with bf16 parameters, checkpointed against the same without: max |difference|."""
    policy = dp.ZeRO3(precision=dp.MixedPrecision(param_dtype=torch.bfloat16))
    states = []
    for variant in (how, "none"):
        model = build("transformer", seed=100)
        if variant == "transform":
            dp.checkpoint_activations(model)
        elif variant == "whole":
            user_checkpointed(model)
        dp.parallelize(model, policy)
        states.append(train_chunks(model, "transformer", world, STEPS, PER_RANK))
    return max_state_diff(states[0], states[1])


def grid(world) -> dict:
    out = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        for how in ("transform", "whole"):
            out[strategy, how, "adamw"] = gpt_case(world, strategy, how)
    out["zero3", "transform", "sgd"] = gpt_case(world, "zero3", "transform", "sgd")
    out["ddp", "whole", "sgd"] = gpt_case(world, "ddp", "whole", "sgd")
    out["zero2", "transform", "adafactor"] = gpt_case(world, "zero2", "transform", "adafactor")
    out["zero3", "whole", "adafactor"] = gpt_case(world, "zero3", "whole", "adafactor")
    zero3 = {
        "no prefetch, no reshard": dp.ZeRO3(prefetch=False, reshard_after_forward=False),
        "check_order always": dp.ZeRO3(check_order="always"),
        # units nested in the recomputed block, gathered by its recompute
        "Linear units": dp.ZeRO3(wrap=(torch.nn.Linear,)),
    }
    for name, policy in zero3.items():
        out["zero3", "whole", name] = gpt_case(world, policy, "whole")
    out["zero3", "whole", "no early stop"] = gpt_case(world, "zero3", "whole", early_stop=False)
    out["zero3", "whole", "no_sync x2"] = gpt_case(world, "zero3", "whole", accum=2)
    out["zero3", "transform", "no_sync x2"] = gpt_case(world, "zero3", "transform", accum=2)
    out["zero3", "none", "adamw"] = gpt_case(world, "zero3", "none")  # the counter's baseline
    out["bf16 params"] = {how: bf16_case(world, how) for how in ("transform", "whole")}
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(2, grid, timeout=400)


def test_every_strategy_matches_one_process_with_blocks_recomputed(results):
    for rank, out in enumerate(results):
        bf16 = out.pop("bf16 params")
        assert len(out) == 19, sorted(out)  # 4 strategies x 2 forms, 10 variants, baseline
        for case, (diff, forwards) in out.items():
            # Measured: 0 for every case (AdamW, SGD, Adafactor; 2 ranks sum as one process).
            assert diff < 1e-6, (rank, case, diff)
            assert forwards == (1 if case[1] == "none" else 2), (rank, case, forwards)
        # The recompute is bit-identical to the forward: bf16 ZeRO-3 equals itself without it.
        assert bf16 == {"transform": 0.0, "whole": 0.0}, bf16


def hsdp_grid(world) -> dict:
    mesh = dp.init_mesh(2)  # 2 replicas x 2 shards
    cases = [("zero3", "transform"), ("zero3", "whole"), ("zero2", "transform"), ("ddp", "whole")]
    return {
        (s, how): gpt_case(world, s, how, mesh=None if s == "ddp" else mesh) for s, how in cases
    }


def test_hsdp_matches_one_process_with_blocks_recomputed():
    for out in run_world(4, hsdp_grid, timeout=300):
        assert len(out) == 4, sorted(out)
        for case, (diff, forwards) in out.items():
            assert diff < 1e-6 and forwards == 2, (case, diff, forwards)


def reentrant_zero3(world):
    model = user_checkpointed(build("transformer", seed=100), reentrant=True)
    dp.parallelize(model, "zero3")
    x, y = batch("transformer", 0, PER_RANK)
    loss_fn("transformer", model, x, y, 0, world.rank).backward()


def test_reentrant_checkpointing_of_a_zero3_unit_is_refused_in_one_line():
    with pytest.raises(RankError) as raised:
        run_world(2, reentrant_zero3, timeout=120)
    assert len(raised.value.errors) == 2
    for text in raised.value.errors.values():
        line = text.strip().splitlines()[-1]
        # the two small blocks are one unit (min_unit_params' default)
        assert "ZeRO3: unit 'blocks.0-1' was recomputed in backward" in line, line
        assert "pass use_reentrant=False" in line, line


# -- Hugging Face: transformers' own switch ---------------------------------------------------
def hf_world(world, path, lora):
    from transformers import AutoModelForCausalLM

    from dataparallel.models.hf import HFSource
    from dataparallel.models.lora import LoraSpec

    spec = LoraSpec.parse(lora) if lora else None
    g = torch.Generator().manual_seed(0)
    out = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        source = HFSource.open(path)
        model = source.build(lora=spec)
        dp.checkpoint_activations(model)
        fill = source.materializer(model)
        if strategy == "zero3":
            dp.parallelize(model, dp.ZeRO3(materialize=fill))
        else:
            fill(list(model.parameters()))
            dp.parallelize(model, strategy)
        start = dp.full_state_dict(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = dp.build_optimizer(model, torch.optim.AdamW, params=params, lr=1e-3)
        reference = AutoModelForCausalLM.from_pretrained(path).train()
        if spec is not None:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets))
            reference = get_peft_model(reference, config)
            with torch.no_grad():  # the adapters ours drew
                for name, p in reference.named_parameters():
                    if "lora_" in name:
                        p.copy_(start[name])
        ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3)
        layers = model.get_base_model().model.layers if spec else model.model.layers
        calls = [0]
        for layer in layers:
            layer.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        for _ in range(STEPS):
            rows = torch.randint(0, model.config.vocab_size, (4, 17), generator=g)
            for m, o, part in ((model, opt, slice(2 * world.rank, 2 * world.rank + 2)),
                               (reference, ref_opt, slice(None))):  # fmt: skip
                logits = m(rows[part, :-1]).logits
                F.cross_entropy(logits.flatten(0, 1), rows[part, 1:].flatten()).backward()
                o.step()
                o.zero_grad()
        full, theirs = dp.full_state_dict(model), reference.state_dict()
        out[strategy] = (
            max((full[k] - theirs[k]).abs().max().item() for k in theirs),
            calls[0] / (STEPS * len(layers)),
            is_checkpointed(model),
        )
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("hf") / "llama", layers=2, width=32)


@pytest.mark.parametrize("lora", ["", "r=4,alpha=8,targets=q_proj,v_proj"])
def test_hugging_face_layers_recomputed_match_one_process(llama, lora):
    for out in run_world(2, hf_world, llama, lora, timeout=300):
        assert sorted(out) == ["ddp", "zero1", "zero2", "zero3"], sorted(out)
        for strategy, (diff, forwards, switched_on) in out.items():
            assert diff < 2e-5, (strategy, lora, diff)
            assert forwards == 2 and switched_on, (strategy, forwards, switched_on)
