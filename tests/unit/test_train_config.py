"""The run configuration: documented fields, TOML parsing, flag precedence, value checks."""

from __future__ import annotations

from dataclasses import fields

import pytest

from dataparallel.cli import build_parser, resolve_config
from dataparallel.train.checks import check_values, resolve_batch
from dataparallel.train.config import (
    SECTIONS,
    ConfigError,
    RunConfig,
    field_docs,
)
from dataparallel.train.config_toml import apply_mapping, load_toml, to_toml


def test_every_field_is_documented_and_has_a_unique_flag():
    names = []
    for cls in SECTIONS.values():
        docs = field_docs(cls)
        for f in fields(cls):
            assert len(docs.get(f.name, "")) > 20, f"{cls.__name__}.{f.name} lacks a docstring"
            names.append(f.name)
    assert len(names) == len(set(names)) == 60
    # Continuation lines are joined into the entry they continue.
    assert field_docs(SECTIONS["train"])["global_batch"].endswith("0: batch decides.")


def test_written_toml_reads_back_to_the_same_config(tmp_path):
    config = RunConfig().replace(
        data={"paths": ("a b.txt", 'q"uote\\back\nline')}, train={"steps": 7}, optim={"lr": 1e-4}
    )
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config, header="resolved"))
    assert load_toml(path) == config
    text = path.read_text()
    assert text.startswith("# resolved\n")
    assert (
        "# optimizer steps of the whole run (the LR schedule spans them). (--steps)\nsteps = 7"
        in text
    )


def test_toml_types_are_checked_and_ints_accepted_for_floats(tmp_path):
    assert apply_mapping(RunConfig(), {"optim": {"lr": 1}}, "f").optim.lr == 1.0
    with pytest.raises(ConfigError, match=r"train.steps: 2.5 in f is not a int"):
        apply_mapping(RunConfig(), {"train": {"steps": 2.5}}, "f")
    with pytest.raises(
        ConfigError, match=r"\[trian\]: unknown section in f; did you mean \[train\]"
    ):
        apply_mapping(RunConfig(), {"trian": {"steps": 2}}, "f")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_toml(bad)


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = 50\nbatch = 3\n[model]\nname = "gpt-small"\n')
    args = build_parser().parse_args(
        ["train", "--config", str(path), "--steps", "9", "--out", "x", "--data", "a", "b"]
    )
    config = resolve_config(args, decided=None)
    assert (config.train.steps, config.train.batch, config.model.name) == (9, 3, "gpt-small")
    assert config.data.paths == ("a", "b")
    assert config.train.accum == RunConfig().train.accum


def test_global_batch_derives_the_per_rank_batch():
    config = RunConfig().replace(train={"global_batch": 24, "accum": 3}, launch={"nproc": 2})
    resolved = resolve_batch(config)
    assert (resolved.train.batch, resolved.train.global_batch, resolved.global_batch) == (4, 0, 24)
    uneven = resolve_batch(config.replace(train={"global_batch": 25}))  # 9,8,8 in 3 micro-steps
    assert (uneven.train.batch, uneven.train.global_batch, uneven.global_batch) == (5, 25, 25)
    with pytest.raises(ConfigError, match=r"5 windows leave some .* = 6 micro-batches empty"):
        resolve_batch(config.replace(train={"global_batch": 5}))


def test_a_batch_flag_replaces_a_global_batch_from_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nglobal_batch = 64\n")
    args = build_parser().parse_args(["train", "--config", str(path), "--batch", "5", "--out", "x"])
    assert resolve_config(args, decided=None).train.batch == 5
    args = build_parser().parse_args(["train", "--batch", "5", "--global-batch", "8", "--out", "x"])
    with pytest.raises(ConfigError, match="both given"):
        resolve_config(args, decided=None)


def test_torchrun_decides_the_world():
    args = build_parser().parse_args(["train", "--out", "x"])
    config = resolve_config(args, decided={"nproc": 3, "nnodes": 2, "node_rank": 1})
    assert config.world_size == 6 and config.launch.node_rank == 1


@pytest.mark.parametrize(
    "changes, label",
    [
        ({"train": {"steps": 0}}, "--steps (train.steps)"),
        ({"optim": {"lr": 0.0}}, "--lr (optim.lr)"),
        ({"data": {"val_fraction": 1.0}}, "--val-fraction (data.val_fraction)"),
        ({"optim": {"beta2": 1.0}}, "--beta2 (optim.beta2)"),
        ({"train": {"stop_after": 700}}, "--stop-after (train.stop_after)"),
        ({"launch": {"nnodes": 2, "rdzv_endpoint": "host"}}, "--rdzv-endpoint"),
        ({"launch": {"node_rank": 1}}, "--node-rank (launch.node_rank)"),
        ({"optim": {"lr_scaling": "sqrt"}}, "--lr-scaling (optim.lr_scaling)"),
        ({"launch": {"collective_timeout": -1.0}}, "--collective-timeout"),
    ],
)
def test_bad_values_name_their_field(changes, label):
    with pytest.raises(ConfigError) as error:
        check_values(RunConfig().replace(**changes))
    assert str(error.value).startswith(label)
    assert "; " in str(error.value)


def test_defaults_pass_the_checks():
    check_values(RunConfig())


def test_the_example_config_is_valid():
    from pathlib import Path

    example = Path(__file__).parents[2] / "examples" / "train.toml"
    config = resolve_batch(load_toml(example))
    check_values(config)
    assert (config.model.name, config.train.batch, config.train.accum) == ("gpt-small", 8, 2)


def test_the_watchdog_flags_read_from_the_command_line_and_toml(tmp_path):
    assert (RunConfig().launch.collective_timeout, RunConfig().launch.check_collectives) == (
        300.0,
        False,
    )
    args = ["train", "--collective-timeout", "5", "--check-collectives", "--out", "x"]
    config = resolve_config(build_parser().parse_args(args), decided=None)
    assert (config.launch.collective_timeout, config.launch.check_collectives) == (5.0, True)
    path = tmp_path / "c.toml"
    path.write_text("[launch]\ncollective_timeout = 0\ncheck_collectives = true\n")
    args = ["train", "--config", str(path), "--out", "x"]
    config = resolve_config(build_parser().parse_args(args), decided=None)
    assert (config.launch.collective_timeout, config.launch.check_collectives) == (0.0, True)
    args += ["--no-check-collectives"]  # a flag turns the file's true off again
    assert not resolve_config(
        build_parser().parse_args(args), decided=None
    ).launch.check_collectives
    assert "check_collectives = true\n" in to_toml(config)
    with pytest.raises(ConfigError, match=r"launch.check_collectives: 'yes' in f is not a bool"):
        apply_mapping(RunConfig(), {"launch": {"check_collectives": "yes"}}, "f")
    with pytest.raises(
        ConfigError,
        match=r"^--collective-timeout \(launch.collective_timeout\): "
        r"-1.0 is below 0; use 0 or more$",
    ):
        check_values(RunConfig().replace(launch={"collective_timeout": -1.0}))


def test_the_header_shows_how_the_ranks_share_the_global_batch():
    from dataparallel.train.console import describe_split

    assert describe_split(8, 1, 3) == "8 = 3,3,2 windows per rank"
    assert describe_split(16, 2, 3) == "16 = 6,5,5 windows per rank in 2 micro-steps"
    assert describe_split(8, 1, 2) == "8 = 4 windows per rank"


@pytest.mark.parametrize(
    "launch, message",
    [
        (
            {"min_replicas": 2},
            "--min-replicas (launch.min_replicas): replicas join, leave and find the run's store "
            "only under --recovery live; add --recovery live, or leave it out",
        ),
        (
            {"recovery": "live", "min_replicas": 0},
            "--min-replicas (launch.min_replicas): 0 is below 1; use 1 or more",
        ),
        (
            {"recovery": "live", "min_replicas": 3},
            "--min-replicas (launch.min_replicas): 3 is above --nproc 2; use at most 2",
        ),
        (
            {"recovery": "live", "max_replicas": 1},
            "--max-replicas (launch.max_replicas): 1 is below --nproc 2; use at least 2, or 0 "
            "for --nproc",
        ),
        (
            {"store_host": "10.0.0.7"},
            "--store-host (launch.store_host): replicas join, leave and find the run's store only "
            "under --recovery live; add --recovery live, or leave it out",
        ),
    ],
)
def test_the_sizes_of_a_live_run_are_checked(launch, message):
    with pytest.raises(ConfigError) as error:
        check_values(RunConfig().replace(launch={"nproc": 2, **launch}))
    assert str(error.value) == message
    check_values(
        RunConfig().replace(launch={"recovery": "live", "min_replicas": 2, "max_replicas": 4})
    )


@pytest.mark.parametrize(
    "launch, sync, message",
    [
        (
            {"strategy": "zero2"},
            {},
            "--recovery (launch.recovery): live recovery does not cover strategy yet; use "
            "--strategy ddp, or zero1/2/3 inside replicas of --shard-group S ranks",
        ),
        (
            {"strategy": "zero2", "shard_group": 2},
            {"diloco": 10},
            "--recovery (launch.recovery): live recovery does not cover shard_group yet; use "
            "--compress, --local-sgd or --diloco without --shard-group",
        ),
        (
            {"strategy": "zero3", "shard_group": 2, "min_replicas": 3},
            {},
            "--min-replicas (launch.min_replicas): 3 is above the run's 2 replicas (--nproc / "
            "--shard-group); use at most 2",
        ),
    ],
)
def test_live_hsdp_replicas_are_checked(launch, sync, message):
    """[Note: HSDP replicas]: a replica of --shard-group S ranks under ZeRO; sizes in replicas."""
    given = {"recovery": "live", "nproc": 4, **launch}
    with pytest.raises(ConfigError) as error:
        check_values(RunConfig().replace(launch=given, sync=sync))
    assert str(error.value) == message
    for strategy in ("zero1", "zero2", "zero3"):
        ok = {"recovery": "live", "nproc": 4, "strategy": strategy, "shard_group": 2}
        check_values(RunConfig().replace(launch={**ok, "min_replicas": 2, "max_replicas": 2}))
