"""The common [train] settings, declared by the component that reads each (config.COMMON_SECTIONS), still make
one flat [train] table: every field is a `train.X` key in config.toml, a flag and a `--set train.X=...`; a
config.toml written before the split loads to the same TrainConfig and saves back byte for byte; and a stage
whose stages.toml section is missing is named as such."""

from __future__ import annotations

import tomllib
from dataclasses import fields

import pytest

from codeforge import config
from codeforge.cli import build_parser, main
from codeforge.config import (COMMON_SECTIONS, STAGES, CommonTrain, ConfigError, RunConfig, TrainConfig,
                              dumps_toml, load_file, resolve)
from codeforge.fields import default_of, flag_name

# a run directory's config.toml as codeforge wrote it before the common section was split by component: one
# flat [train] table in the saved key order, values other than the defaults in every component
OLD_CONFIG_TOML = """\
[model]
arch = "gpt"
vocab_size = 1024
block_size = 128
n_layer = 2
n_head = 2
n_embd = 64
n_kv_head = 2
mlp = "gelu"
ffn_hidden = 256
norm = "layernorm"
norm_eps = 1e-05
pos = "learned"
rope_base = 10000.0
qk_norm = false
tie_embeddings = true
bias = true
embd_dropout = 0.0
attn_dropout = 0.0
resid_dropout = 0.0

[train]
stage = "sft"
data = "prepared/chat"
tokenizer = ""
out = "runs/chat"
batch_size = 4
grad_accum_steps = 2
learning_rate = 5e-05
min_lr_ratio = 0.05
schedule = "wsd"
warmup_steps = 20
decay_fraction = 0.3
max_iters = 120
max_tokens = 0
epochs = 0.0
weight_decay = 0.05
beta1 = 0.9
beta2 = 0.99
grad_clip = 0.5
optimizer = "adamw"
muon_lr = 0.02
muon_momentum = 0.95
muon_weight_decay = 0.0
eval_every = 40
time_budget = 0.0
eval_tokens = 8192
sample_every = 60
sample_tokens = 32
syntax_cases = 8
save_every = 40
keep_last = 2
log_every = 5
seed = 7
device = "cpu"
threads = 2
precision = "fp32"
compile = false
grad_checkpointing = true
local_ranks = 1
parallel = "ddp"
fsdp_offload = false
async_checkpoint = "off"
dist_timeout = 300
fim_rate = 0.0
fim_spm_rate = 0.5
loss_chunk_rows = 0
max_bad_steps = 3
beta = 0.1
dpo_sft = 0.0
kl_coef = 0.0
rewards = "auto"
reward_model = ""
group_size = 4
rollout_tasks = 8
rollout_tokens = 128
rollout_temperature = 1.0
ppo_epochs = 1
clip_eps = 0.2
gae_gamma = 1.0
gae_lambda = 0.95
vf_coef = 0.5
eval_tasks = 64
init_from = "runs/base"
lora_rank = 8
lora_alpha = 16.0
lora_dropout = 0.0
lora_targets = "c_attn,c_proj"
tensorboard = false
wandb = false
wandb_project = "chat"
progress = false
"""


def another_value(f):
    """A value of field `f` other than its default that its declaration allows."""
    m, d = f.metadata, default_of(f)
    if isinstance(d, bool):
        return not d
    if m.get("choices"):
        return next(c for c in m["choices"] if c != d)
    if isinstance(d, str):
        return "x"
    lo, hi = m["range"]
    for v in (lo + 1, lo + 2, (lo + hi) / 2):
        v = type(d)(v)
        if v != d and (lo < v if m.get("open_low") else lo <= v) and v <= hi:
            return v
    raise AssertionError(f"no other value for {f.name}")


def train_actions() -> dict:
    parser = build_parser()
    train = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)
                 ).choices["train"]
    return {a.dest: a for a in train._actions}


def test_the_components_partition_the_common_section_in_their_order():
    names = [f.name for cls in COMMON_SECTIONS.values() for f in fields(cls)]
    assert len(names) == len(set(names)) == 51
    # CommonTrain's fields are the components' own, in COMMON_SECTIONS' order (its bases listed last-first)
    assert [f.name for f in fields(CommonTrain)] == names
    assert set(names) <= {f.name for f in fields(TrainConfig)}
    for name, cls in COMMON_SECTIONS.items():  # each names the module that reads it
        assert ".py" in cls.__doc__, name


@pytest.mark.parametrize("component", list(COMMON_SECTIONS))
def test_each_component_is_flat_train_keys_flags_and_sets(component):
    cls = COMMON_SECTIONS[component]
    table = tomllib.loads(dumps_toml(RunConfig().to_dict()))["train"]
    actions = train_actions()
    for f in fields(cls):
        assert f.name in table, f"{f.name} is not a key of the saved [train] table"
        action = actions[f"train.{f.name}"]
        assert flag_name(f) in action.option_strings, (f.name, action.option_strings)
        v = another_value(f)
        if f.name != "init_from":  # --init-from would look for that run's checkpoint
            assert getattr(resolve(sets=[f"train.{f.name}={v}"]).train, f.name) == v
        given = ([flag_name(f) if v else "--no-" + flag_name(f)[2:]] if isinstance(v, bool)
                 else [flag_name(f), str(v)])
        parsed = build_parser().parse_args(["train", *given])
        assert getattr(parsed, f"train.{f.name}") == v, f.name


def test_a_component_field_out_of_range_is_named_as_a_train_key():
    with pytest.raises(ConfigError, match=r"train\.keep_last = 0 is out of range"):
        resolve(sets=["train.keep_last=0"])


def test_config_keys_lists_the_common_settings_by_component(capsys):
    assert main(["config", "keys"]) == 0
    out = capsys.readouterr().out
    heads = [out.index(f"  # {name}: ") for name in COMMON_SECTIONS]
    assert heads == sorted(heads)
    ends = [*heads[1:], out.index("# --stage pretrain")]
    for (name, cls), start, end in zip(COMMON_SECTIONS.items(), heads, ends):
        for f in fields(cls):
            assert start < out.index(f"  train.{f.name} ") < end, (name, f.name)


def test_a_config_toml_from_before_the_split_loads_the_same(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(OLD_CONFIG_TOML)
    # compile was true/false before it became an auto/on/off switch: false reads as "off"
    old_train = {**tomllib.loads(OLD_CONFIG_TOML)["train"], "compile": "off"}
    expected = TrainConfig(**old_train)
    assert expected.schedule == "wsd" and expected.keep_last == 2 and expected.tensorboard is False
    # --resume builds on the saved file
    resumed = resolve(base=load_file(path))
    assert resumed.train == expected
    # saved again in the same order, byte for byte but the switch's new spelling, settings added since (at
    # their defaults) after it
    again = dumps_toml(resumed.to_dict())
    before = OLD_CONFIG_TOML.replace("compile = false", 'compile = "off"')
    assert again.startswith(before) and again[len(before):] == (
        'compile_shapes = "static"\nhost_sync = "auto"\nprefetch = "auto"\nattention = "auto"\n')
    # and as a --config file (its --init-from left out: that run is not here)
    given = resolve(file=str(path), flags={"train.init_from": ""})
    assert given.train == TrainConfig(**{**old_train, "init_from": ""})


def test_a_stage_without_its_stages_toml_section_says_what_is_missing(monkeypatch):
    tables = config._preset_tables()
    del tables["stage"]["dpo"]
    monkeypatch.setattr(config, "_preset_tables", lambda: tables)
    with pytest.raises(ConfigError) as e:
        resolve(flags={"train.stage": "dpo"})
    msg = str(e.value)
    assert "stages.toml has no [dpo] section" in msg and "add one" in msg
    assert "is not one of" not in msg  # dpo is a stage: the old message said it was not
    assert "dpo" in STAGES
    with pytest.raises(ConfigError, match=r"train\.stage = 'simpo' is not one of"):  # a stage no table has
        resolve(flags={"train.stage": "simpo"})
