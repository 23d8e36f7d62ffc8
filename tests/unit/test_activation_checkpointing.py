"""`dp.checkpoint_activations` in one process, and the job's flag: which modules it recomputes,
that the numbers and the state dict stay the same, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.activation_checkpointing import is_checkpointed
from dataparallel.cli import build_parser, resolve_config
from dataparallel.models import GPT, GPTConfig, build_model
from dataparallel.train.checks import check_values
from dataparallel.train.config import ConfigError, RunConfig


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=3, n_head=2, n_embd=16))


def grads_and_saved(model: nn.Module) -> tuple[list[torch.Tensor], int]:
    """The gradients of one step, and the bytes autograd kept from forward to backward that
    are not parameters (the activations: for a recomputed block, its input alone)."""
    saved = [0]
    params = {p.data_ptr() for p in model.parameters()}

    def pack(t):
        if t.data_ptr() not in params:
            saved[0] += t.numel() * t.element_size()
        return t

    x = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    return [p.grad.clone() for p in model.parameters()], saved[0]


def test_each_block_is_recomputed_with_the_same_gradients_and_state_dict_keys():
    plain, recomputed = tiny_gpt(), tiny_gpt()
    keys = list(recomputed.state_dict())
    assert dp.checkpoint_activations(recomputed) is recomputed
    assert dp.checkpoint_activations(recomputed) is recomputed  # a second call changes nothing
    assert list(recomputed.state_dict()) == keys  # no wrapper, no key prefix
    assert is_checkpointed(recomputed) and not is_checkpointed(plain)
    calls = [0]
    for block in recomputed.blocks:
        block.attn.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    theirs, kept_plain = grads_and_saved(plain)
    ours, kept = grads_and_saved(recomputed)
    assert calls[0] == 2 * 3  # every block's forward again in backward, once
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    # Kept: 3 block inputs of 4 x 15 x 16 fp32 = 11,520 bytes, against every block's tensors.
    assert kept < kept_plain / 4, (kept, kept_plain)


def test_blocks_by_class_or_callable_and_a_model_without_blocks_refused():
    model = build_model("mlp")
    with pytest.raises(ValueError, match="blocks selected no module of MLP .* pass blocks="):
        dp.checkpoint_activations(model)
    dp.checkpoint_activations(model, blocks=(nn.Linear,))
    assert sum(is_checkpointed(m) for m in model.net if isinstance(m, nn.Linear)) == 3
    gpt = tiny_gpt()
    dp.checkpoint_activations(gpt, blocks=lambda m: m is gpt.blocks[1])
    assert [is_checkpointed(b) for b in gpt.blocks] == [False, True, False]


def test_the_flag_and_the_toml_key(tmp_path):
    assert RunConfig().train.activation_checkpointing is False
    args = ["train", "--activation-checkpointing", "--out", "x"]
    config = resolve_config(build_parser().parse_args(args), decided=None)
    assert config.train.activation_checkpointing is True
    path = tmp_path / "c.toml"
    path.write_text("[train]\nactivation_checkpointing = true\n")
    args = ["train", "--config", str(path), "--no-activation-checkpointing", "--out", "x"]
    config = resolve_config(build_parser().parse_args(args), decided=None)
    assert config.train.activation_checkpointing is False


def test_a_model_without_blocks_is_refused_in_one_line():
    config = RunConfig().replace(model={"name": "mlp"}, train={"activation_checkpointing": True})
    with pytest.raises(ConfigError) as error:
        check_values(config)
    text = str(error.value)
    assert text.startswith("--activation-checkpointing (train.activation_checkpointing): mlp ")
    assert "leave it out" in text and "\n" not in text
    check_values(config.replace(model={"name": "gpt-tiny"}))  # a GPT passes
