"""Bad configurations fail early, with the field and its allowed range, from Python and the command line."""

import argparse
import json
import re
from dataclasses import fields

import pytest
import torch
from small import T, make_lm, random_tokens, small_cfg

from switchbench.bench.command import FIELD_HELP, add_config_args, config_from_args
from switchbench.cli import main
from switchbench.models import family as registry
from switchbench.models.config import (
    MLP_FIELDS,
    POSITIONS,
    ROUTING_FIELDS,
    XL_FIELDS,
    ModelConfig,
    changeable_fields,
    unread,
)
from switchbench.models.presets import PRESETS, from_name

BAD = [
    (dict(model="switchhead", n_experts=4, k=5), "k must be in [1, 4]"),
    (dict(d_model=0), "d_model must be >= 1; got 0"),
    (dict(n_heads=-2), "n_heads"),
    (dict(pos="alibi"), "pos must be one of xl, rope"),
    (dict(model="gpt"), "model must be one of"),
    (dict(model="switchhead", experts=""), "experts must be a non-empty subset of 'qkvo'"),
    (dict(model="switchhead", experts="vx"), "experts"),
    (dict(model="switchhead", experts="vv"), "experts"),
    (dict(context_blocks=-1), "context_blocks"),
    (dict(causal=False, context_blocks=1), "context_blocks must be 0 when causal is False"),
    (dict(model="moa", n_heads=12, n_experts=10), "n_heads must be in [1, 10]"),
    (dict(model="moa", n_heads=2, moa_gating="relu"), "moa_gating must be one of softmax, sigmoid"),
    (dict(model="switchall", mlp_k=20, mlp_experts=16), "mlp_k must be in [1, 16]"),
    (dict(dropout=1.0), "dropout must be in [0.0, 1.0)"),
    (dict(d_model="412"), "d_model must be an integer"),
    (dict(entropy_reg=-0.1), "entropy_reg"),
    (dict(xl_bias_and_scale="yes"), "xl_bias_and_scale must be True or False; got 'yes'"),
    (dict(causal=1), "causal must be True or False"),
]


@pytest.mark.parametrize("changes, message", BAD)
def test_bad_config_names_field_and_range(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig(**changes)


def test_fields_of_other_families_are_not_checked():
    """A dense model does not care about its unused expert settings."""
    ModelConfig(model="transformer", n_experts=2, k=7)


# A valid value other than small_cfg's for each field only some models read
CHANGED = {
    "n_experts": 5,
    "k": 1,
    "experts": "qvo",
    "shared_selection": True,
    "entropy_reg": 0.5,
    "expert_dropout": 0.5,
    "moa_gating": "sigmoid",
    "moa_cv_coef": 0.7,
    "moa_switch_coef": 0.7,
    "moa_z_coef": 0.7,
    "d_ff": 40,
    "mlp_experts": 5,
    "mlp_expert_size": 6,
    "mlp_k": 1,
    "mlp_entropy_reg": 0.3,
    "mlp_expert_dropout": 0.5,
    "xl_bias_and_scale": False,
}


def _training_step(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    model = make_lm(cfg).train()
    torch.manual_seed(1)  # the same dropout draws
    out = model(random_tokens(cfg, T))
    return out.logits, torch.as_tensor(out.aux_loss)


@pytest.mark.parametrize(  # beyond dense and SwitchHead, a family sweep's cases are slow (docs/layout.md)
    "model",
    [
        m if m in ("transformer", "switchhead") else pytest.param(m, marks=pytest.mark.slow)
        for m in registry.names()
    ],
)
def test_a_field_is_refused_exactly_where_the_model_would_ignore_it(model):
    """Each field only some models read, changed on each family's model: where `unread` says the model ignores it,
    a training step (logits and auxiliary loss, same weights and dropout draws) is bit for bit the same; where it
    reads it, the step changes. So a refused change is always a no-op, and an accepted one never is."""
    assert set(CHANGED) == set(ROUTING_FIELDS + XL_FIELDS) | {
        f for fields in MLP_FIELDS.values() for f in fields
    }
    for pos in POSITIONS:
        _refused_exactly_where_ignored(small_cfg(model, pos), CHANGED if pos == "xl" else XL_FIELDS)


def _refused_exactly_where_ignored(base: ModelConfig, names) -> None:
    logits, aux = _training_step(base)
    for name, value in ((name, CHANGED[name]) for name in names):
        changed = base.replace(**{name: value})
        new_logits, new_aux = _training_step(changed)
        same = (
            new_logits.shape == logits.shape and torch.equal(new_logits, logits) and torch.equal(new_aux, aux)
        )
        assert same == (unread(changed, [name]) == [name]), (base.model, base.pos, name)


def test_unread_fields_are_refused_by_flags_and_preset_changes(capsys):
    assert main(["params", "wikitext103-47m-moa-h4", "--k", "3"]) == 2
    assert capsys.readouterr().err.strip().endswith("--k: no effect on a moa model, which does not read it")
    with pytest.raises(ValueError, match="n_experts: no effect on a transformer model"):
        from_name("c4-47m-transformer-h10:n_experts=3")
    assert from_name("wikitext103-47m-moa-h4:n_experts=12").n_experts == 12
    with pytest.raises(
        ValueError, match="xl_bias_and_scale: no effect on a transformer model with RoPE positions"
    ):
        from_name("tiny-transformer-rope:xl_bias_and_scale=False")  # it was read without a word
    with pytest.raises(ValueError, match="n_experts: no effect on a transformer model, which"):
        from_name("tiny-transformer-rope:n_experts=3")  # RoPE is not why


def test_unknown_preset_suggests_close_names():
    with pytest.raises(ValueError, match="c4-47m-switchhead-h2"):
        from_name("c4-47m-switchhead-h3")


def test_a_preset_with_changed_fields_is_the_preset_replaced():
    """``NAME:field=value,...``, each value read as its field's type: how a context sweep names its members."""
    base = PRESETS["wikitext103-244m-transformer-h16"]
    changed = from_name("wikitext103-244m-transformer-h16:T=4096,dropout=0.0,causal=True,pos=rope")
    assert changed == base.replace(T=4096, dropout=0.0)
    assert from_name("c4-47m-switchhead-h2") is PRESETS["c4-47m-switchhead-h2"]


def test_every_configuration_flag_says_what_it_sets():
    """The 33 configuration flags had no help; a field added without one is named here."""
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    flags = {a.dest: a.help for a in parser._actions if a.dest in {f.name for f in changeable_fields()}}
    assert len(flags) == len(changeable_fields()) and all(flags.values()), [
        d for d, h in flags.items() if not h
    ]
    assert set(FIELD_HELP) == {f.name for f in fields(ModelConfig)} - {"options"}
    assert flags["n_kv_heads"].endswith("(gqa)") and flags["routed_k"].endswith("(moh)")  # whose option it is


def test_a_preset_change_sets_a_family_option_as_its_flag_does():
    """``tiny-moh:routed_k=2`` was refused (only ModelConfig fields were read) although ``--routed-k 2`` worked."""
    base = PRESETS["tiny-moh"]
    changed = from_name("tiny-moh:routed_k=2,moh_router=norm,balance_coef=0.0")
    assert changed == base.replace(
        options=dict(base.options) | {"routed_k": 2, "moh_router": "norm", "balance_coef": 0.0}
    )
    assert changed.opts.shared_heads == base.opts.shared_heads  # the options not named carry over
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(["tiny-moh", "--routed-k", "2", "--moh-router", "norm", "--balance-coef", "0"])
    assert config_from_args(args) == changed
    # another family starts from its own defaults, as the flag does
    assert from_name("tiny-gqa-kv2:model=transformer") == PRESETS["tiny-gqa-kv2"].replace(
        model="transformer", options=()
    )
    with pytest.raises(ValueError, match="model transformer takes no options; got n_kv_heads"):
        from_name("tiny-transformer:n_kv_heads=2")
    with pytest.raises(ValueError, match="routed_k must be int; got 'x'"):
        from_name("tiny-moh:routed_k=x")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("c4-47m-switchhead-h2:T", "'T' is no FIELD=VALUE"),
        ("c4-47m-switchhead-h2:colour=1", "'colour=1' is no FIELD=VALUE"),
        ("c4-47m-switchhead-h2:T=long", "T must be int; got 'long'"),
        ("c4-47m-switchhead-h2:causal=yes", "causal must be True or False"),
        ("c4-47m-switchhead-h2:k=9", "k must be in"),
        ("c4-47m-switchhead-h3:T=8", "did you mean c4-47m-switchhead-h2"),
        # each was read without a word: the last of a repeated field won, and an empty list changed nothing
        ("c4-47m-switchhead-h2:k=1,k=2", "k is given twice"),
        ("c4-47m-switchhead-h2:", "no FIELD=VALUE after ':'"),
    ],
)
def test_a_bad_change_is_named(name, message):
    with pytest.raises(ValueError, match=message):
        from_name(name)


def test_config_round_trips_through_a_dict():
    cfg = PRESETS["c4-262m-switchall-h4"]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown config fields: colour"):
        ModelConfig.from_dict({**cfg.to_dict(), "colour": 1})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["params", "--model", "switchhead", "--k", "9"], "k must be in [1, 5]"),
        (  # the default's 10 heads, which the user never gave, are named as such
            ["params", "--model", "moa"],
            "n_heads must be in [1, 5]; got 10 (without --preset, what no flag sets is the default configuration's",
        ),
        (["params", "no-such-preset"], "unknown preset 'no-such-preset'"),
        (["params", "--d-model", "abc"], "invalid int value"),
        (["params", "--pos", "alibi"], "invalid choice"),
        (
            ["params", "--model", "moh", "--moh-router", "top2"],
            "invalid choice: 'top2' (choose from 'softmax', 'norm')",
        ),
        (["params", "--model", "switchhead", "--experts", "x"], "experts must be a non-empty subset"),
        (["params", "--model", "switchhead", "--experts", ""], "--experts is empty; give a value"),
        # past 32 bits: refused by name, not an overflow inside torch (exit 3)
        (["params", "--d-model", str(10**30)], f"--d-model must be <= 2147483647; got {10**30}"),
        (
            ["params", "tiny-switchhead:n_experts=" + str(2**31)],
            f"n_experts must be <= 2147483647; got {2**31}",
        ),
        (["count", "tiny-switchhead", "--T", str(2**62)], "--T must be <= 2147483647"),
        (["speed", "--quick", "--batch", str(10**30)], "--batch must be <= 2147483647"),
        (["decode", "tiny-switchhead", "--contexts", "8", str(10**30)], "--contexts must be <= 2147483647"),
        (["gate", "--rounds", str(10**30)], "--rounds must be <= 2147483647"),
        # a newline in a path the user gave is shown escaped: the error stays one line
        (["check", "a\nb", "--baseline", "nowhere.json"], "a\\nb"),
        (["params", "--pos", "al\nibi"], "al\\nibi"),
    ],
)
def test_cli_rejects_bad_configs_with_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.splitlines()) == 1, err  # argparse's own errors too: no usage block before the line


def test_cli_params_json_overrides_the_preset(capsys):
    assert main(["params", "c4-47m-switchhead-h2", "--n-heads", "3", "--d-head", "112", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["n_heads"] == 3 and out["config"]["k"] == 3
    assert out["per_layer"]["attention"] == 2 * 412 * 336 + 2 * 15 * 412 * 112 + 2 * 412 * 15 + 412 * 336


def test_a_table_names_a_preset_the_flags_changed_as_changed(capsys):
    """`params tiny-transformer --model gqa` headed its GQA model "tiny-transformer", a dense preset."""
    for argv, label in (
        (
            ["tiny-transformer", "--model", "gqa", "--n-kv-heads", "2"],
            "tiny-transformer, changed by flags: gqa",
        ),
        (
            ["tiny-transformer", "--d-model", str(PRESETS["tiny-transformer"].d_model)],
            "tiny-transformer: transformer",
        ),
        ([], "custom: transformer"),
    ):
        assert main(["params", *argv]) == 0
        assert capsys.readouterr().out.startswith(label + " (xl)")


@pytest.mark.parametrize(("dense", "moa"), [("transformer", "moa"), ("dense", "moa")])
def test_every_flag_that_names_a_family_takes_its_name_or_its_key(dense, moa, capsys):
    """The dense family is `transformer` in a configuration and `dense` to train and quality; each flag used to
    refuse the other's spelling. Both now name the same family: params reads them as a configuration's name."""
    assert main(["params", "c4-47m-switchhead-h2", "--model", dense, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["model"] == "transformer"
    assert main(["params", "c4-47m-switchhead-h2", "--model", moa, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["model"] == "moa"


@pytest.mark.slow  # a subprocess or a timing: seconds each, in tox
def test_cli_presets_lists_every_preset(capsys):
    assert main(["presets", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["preset"] for r in rows] == list(PRESETS)
