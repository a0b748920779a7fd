"""train / generate / eval as a user runs them, including bad input."""

import json
import shutil

import pytest

from codeforge.cli import main


@pytest.fixture(scope="module")
def run_dir(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "r"
    assert main(["train", "--data", str(data_dir), "--out", str(out), "--n-layer", "2", "--n-head", "2",
                 "--n-embd", "64", "--block-size", "64", "--batch-size", "4", "--max-iters", "8",
                 "--eval-every", "4",
                 "--eval-tokens", "128", "--sample-every", "4", "--no-progress", "--device", "cpu"]) == 0
    return out


def test_generate_prints_prompt_and_completion(run_dir, capsys):
    assert main(["generate", "--run", str(run_dir), "--prompt", "def f(x):", "--max-new-tokens", "8",
                 "--seed", "1", "--num-samples", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("def f(x):") == 2 and "--- sample 2 ---" in out
    assert (run_dir / "samples.jsonl").exists()


def test_generate_from_stdin_and_empty_prompt(run_dir, capsys, monkeypatch):
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["generate", "--run", str(run_dir), "--max-new-tokens", "4", "--seed", "0"]) == 0
    assert "empty prompt" in capsys.readouterr().err


def test_eval_json_keys(run_dir, capsys):
    assert main(["eval", "--run", str(run_dir), "--eval-tokens", "128", "--syntax-samples", "2",
                 "--humaneval", "1", "--samples-per-problem", "2", "--k", "1", "2", "--max-new-tokens", "16",
                 "--json"]) == 0
    said = capsys.readouterr()
    r = json.loads(said.out)
    # each part says when it starts and how long it took, on stderr (stdout stays one JSON object)
    for part in ("validation loss on 128 tokens", "syntax of up to 2 completions", "HumanEval: 1 problems"):
        assert f"eval: {part}" in said.err and said.err.count(part) == 2, said.err
    for k in ("val_loss", "perplexity", "bits_per_byte", "syntax_valid_rate", "pass_at_1", "pass_at_k"):
        assert k in r
    assert r["pass_at_k"] == {"2": 0.0} or set(r["pass_at_k"]) == {"2"}
    assert r["val_loss"] > 0 and 0 <= r["syntax_valid_rate"] <= 1
    lines = (run_dir / "eval.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["val_loss"] == r["val_loss"]


def test_bad_runs_and_configs(run_dir, data_dir, tmp_path, capsys):
    assert main(["generate", "--run", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--run", str(run_dir / "checkpoints"), "--prompt", "x"]) == 2
    assert f"pass the run directory {run_dir}" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "no-data"), "--out", str(tmp_path / "y")]) == 2
    cap = capsys.readouterr()
    assert "not a prepared data directory" in cap.err and "device:" not in cap.out + cap.err
    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    for ck in (broken / "checkpoints").iterdir():
        if ck.is_dir():
            shutil.rmtree(ck / "tokenizer")
    assert main(["eval", "--run", str(broken)]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    assert main(["train", "--data", str(data_dir), "--out", str(tmp_path / "x"), "--n-layer", "0"]) == 2
    assert "model.n_layer = 0 is out of range" in capsys.readouterr().err
    assert main(["train", "--data", str(data_dir), "--out", str(run_dir), "--max-iters", "2"]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert main(["train", "--data", str(data_dir), "--out", str(tmp_path / "y"), "--precision", "fp16",
                 "--device", "cpu"]) == 2
    assert "fp16 needs a GPU" in capsys.readouterr().err
    assert main(["generate", "--run", str(run_dir), "--prompt", "x", "--top-p", "0"]) == 2
    assert "generate --top-p = 0.0 is out of range (0.0, 1.0]" in capsys.readouterr().err


def test_presets_command(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "gpt2-small" in out and "124,475,904" in out and "12gb-card" in out


def test_too_little_data_for_batch(data_dir, tmp_path, capsys):
    assert main(["train", "--data", str(data_dir), "--out", str(tmp_path / "z"), "--batch-size", "4096",
                 "--block-size", "4096", "--n-layer", "1", "--device", "cpu"]) == 2
    assert "too few for one batch" in capsys.readouterr().err


def test_one_validation_number_for_one_checkpoint(run_dir, capsys):
    """The number training logged at its final step is the number `codeforge eval` prints for that
    checkpoint, with the run's own eval_tokens, and both say how many tokens they scored."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in recs if "val_loss" in r][-1]
    assert last["step"] == 8 and last["val_tokens"] == 128
    assert main(["eval", "--run", str(run_dir), "--checkpoint", "final", "--syntax-samples", "0",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["eval_tokens"] == 128
    assert r["val_loss"] == pytest.approx(last["val_loss"], abs=1e-6)
    assert r["bits_per_byte"] == pytest.approx(last["val_bpb"], abs=1e-6)
    assert main(["eval", "--run", str(run_dir), "--checkpoint", "final", "--syntax-samples", "0",
                 "--eval-tokens", "0", "--json"]) == 0  # the whole split
    whole = json.loads(capsys.readouterr().out)
    assert whole["eval_tokens"] > 128


def test_unknown_option_suggests_the_right_one(data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--data", str(data_dir), "--out", str(tmp_path / "r"), "--max-itres", "10"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: codeforge train" in err and "did you mean --max-iters" in err
    with pytest.raises(SystemExit):
        main(["generate", "--run", "x", "--tempreature", "1"])
    err = capsys.readouterr().err
    assert "usage: codeforge generate" in err and "did you mean --temperature" in err


def test_train_help_describes_every_flag(capsys):
    import argparse

    from codeforge.cli import build_parser
    train = next(a for a in build_parser()._actions
                 if isinstance(a, argparse._SubParsersAction)).choices["train"]
    settings = [a for g in train._action_groups if g.title.endswith("settings") for a in g._group_actions]
    assert len(settings) > 40
    for a in settings:  # a one-line description, and the default
        assert a.help and ("default" in a.help or "required" in a.help), a.option_strings
    assert all(a.help for a in train._actions), [a.option_strings for a in train._actions if not a.help]
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--warmup-steps N" in out and "TRAIN." not in out
    assert main(["config", "keys"]) == 0
    keys = capsys.readouterr().out
    assert "train.warmup_steps" in keys and "model.n_layer" in keys and "train.eval_tokens" in keys
    # each stage kind's own settings under its stages, after the common ones: beta is DPO's, group_size RL's
    assert keys.index("# --stage reward, dpo") < keys.index("train.beta ") < keys.index("# --stage ppo, grpo")
    assert keys.index("train.warmup_steps") < keys.index("# --stage pretrain") < keys.index("train.fim_rate")
    assert keys.index("# --stage ppo, grpo") < keys.index("train.group_size")


def test_review_findings_bad_values_are_refused(run_dir, data_dir, tmp_path, capsys):
    """Found by review: a negative --eval-tokens scored nothing and reported a perfect 0.0; abbreviated
    options were taken silently; a sandbox timeout of inf crashed the evaluator."""
    assert main(["eval", "--run", str(run_dir), "--syntax-samples", "0", "--eval-tokens", "-5"]) == 2
    assert "eval --eval-tokens = -5 is out of range [1, " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--data", str(data_dir), "--out", str(tmp_path / "a"), "--max-iter", "2"])
    assert "did you mean --max-iters" in capsys.readouterr().err
    from codeforge.sandbox import run_python
    for bad in (float("inf"), 0, -1, 1e19):
        with pytest.raises(ValueError, match="timeout"):
            run_python("pass", timeout=bad)


def test_plan_takes_the_vocabulary_from_the_data(data_dir, capsys):
    """`codeforge plan --data DIR` without a vocabulary size reads it from the data's tokenizer (the path a
    restructuring once left with a broken import)."""
    from codeforge.cli import main
    assert main(["plan", "--data", str(data_dir), "--n-layer", "2", "--n-head", "2", "--n-embd", "64",
                 "--block-size", "32", "--vocab-size", "0"]) == 0
    out = capsys.readouterr().out
    assert "vocab 1024)" in out, out  # the test tokenizer's 1,024 tokens, padded to a multiple of 64


def test_resume_needs_only_the_run(data_dir, tmp_path, capsys):
    """`train --out RUN --resume` takes the data, stage and model from RUN/config.toml; without a run there,
    the error says that --resume found nothing to continue."""
    out = tmp_path / "run"
    tiny = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--device", "cpu",
            "--no-progress", "--eval-tokens", "64", "--batch-size", "2"]
    assert main(["train", "--data", str(data_dir), "--out", str(out), "--max-iters", "2", *tiny]) == 0
    said = capsys.readouterr()
    # the default warm-up (100 steps) is longer than this 2-step run: said, with the fix
    assert "--warmup-steps 100 is longer than the run's 2 steps" in said.out + said.err
    assert "step 0: evaluating (validation every" in said.out + said.err  # the first evaluation is announced
    assert main(["train", "--out", str(out), "--resume", "--max-iters", "3", "--no-progress"]) == 0
    assert "done: step 3" in capsys.readouterr().out
    assert main(["train", "--out", str(tmp_path / "nothing"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--data" in err and "no run to continue" in err
    assert main(["train", "--data", str(data_dir)]) == 2
    assert "--out RUN" in capsys.readouterr().err
    # the same command again with --resume (as a requeued SLURM job runs it): a model preset's vocab_size
    # (tiny: 32,000) gives way to the run's, taken from its data, as it did when the run began
    again = ["train", "--data", str(data_dir), "--out", str(tmp_path / "preset"), "--preset", "tiny", *tiny]
    assert main([*again, "--max-iters", "2"]) == 0
    capsys.readouterr()
    assert main([*again, "--max-iters", "3", "--resume"]) == 0
    assert "done: step 3" in capsys.readouterr().out


def test_help_and_presets_do_not_import_torch():
    """`codeforge --help`, `quickstart --help`, `serve --help` and `presets` answer without loading torch
    (seconds on a busy CPU)."""
    import subprocess
    import sys
    for args in (["--help"], ["quickstart", "--help"], ["serve", "--help"], ["presets"]):
        code = ("import sys, runpy; sys.argv = ['codeforge', *%r]\n"
                "try:\n    runpy.run_module('codeforge', run_name='__main__')\nexcept SystemExit as e:\n"
                "    assert e.code == 0, e.code\nassert "
                "'torch' not in sys.modules, 'torch imported'\n" % (args,))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (args, r.stderr[-2000:])
        assert "usage: codeforge" in r.stdout or "hardware profiles:" in r.stdout


def test_the_presets_catalog_is_current():
    """`codeforge presets` reads codeforge/presets/catalog.json (no torch); it must equal what building each
    preset gives. If this fails after a change to models.toml or a model:
    `codeforge presets --write-catalog`."""
    import json
    from importlib import resources

    from codeforge.catalog import CATALOG
    from codeforge.config import preset_catalog
    shipped = json.loads(resources.files("codeforge.presets").joinpath(CATALOG).read_text())
    assert shipped == preset_catalog(), "stale catalog: run `codeforge presets --write-catalog`"


def test_every_flag_of_every_command_has_help():
    """`codeforge CMD --help` explains every option of every command (and sub-command)."""
    import argparse

    from codeforge.cli import build_parser
    missing, todo = [], [("codeforge", build_parser())]
    while todo:
        name, parser = todo.pop()
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(f"{name} {k}", v) for k, v in a.choices.items()]
            elif not isinstance(a, argparse._HelpAction) and not (a.help or "").strip():
                missing.append(f"{name} {'/'.join(a.option_strings) or a.dest}")
    assert not missing, missing
    r = build_parser().parse_args(["generate", "--run", "x"])  # the help names only flags that exist
    assert not hasattr(r, "prompts_jsonl")


def test_a_model_preset_alone_on_cpu_points_to_the_cpu_recipe(capsys):
    from codeforge.cli.train import _preset_advice
    from codeforge.config import resolve
    _preset_advice(["cpu-small"], resolve(["cpu-small"], sets=["train.device=cpu"]))
    assert "cpu-small lowend-cpu" in capsys.readouterr().err
    _preset_advice(["cpu-small", "lowend-cpu"],
                   resolve(["cpu-small", "lowend-cpu"], sets=["train.device=cpu"]))
    assert capsys.readouterr().err == ""


def test_time_budget_chooses_and_saves_the_step_count(data_dir, tmp_path, capsys):
    """--time-budget S: after a few timed steps the run sets its own step count (at most --max-iters) and
    saves it as max_iters, so --resume (or a re-run with --max-iters N) repeats it."""
    import tomllib
    out = tmp_path / "run"
    assert main(["train", "--data", str(data_dir), "--out", str(out), "--n-layer", "1", "--n-head", "2",
                 "--n-embd", "32", "--block-size", "32", "--batch-size", "2", "--device", "cpu",
                 "--no-progress",
                 "--eval-tokens", "64", "--eval-every", "50", "--warmup-steps", "2", "--max-iters", "1000000",
                 "--time-budget", "3"]) == 0
    said = capsys.readouterr()
    text = said.out + said.err
    assert "time budget 3s" in text and "s/step measured" in text
    saved = tomllib.loads((out / "config.toml").read_text())["train"]
    assert saved["time_budget"] == 0 and 5 < saved["max_iters"] < 1_000_000
    assert f"done: step {saved['max_iters']}," in said.out
    # --resume with a new budget: the resumed run times its steps again and takes what fits from there on
    first = saved["max_iters"]
    assert main(["train", "--out", str(out), "--resume", "--max-iters", "1000000", "--time-budget", "2",
                 "--no-progress"]) == 0
    said = capsys.readouterr()
    again = tomllib.loads((out / "config.toml").read_text())["train"]
    assert "time budget 2s" in said.out + said.err and again["time_budget"] == 0
    assert first < again["max_iters"] < 1_000_000 and f"done: step {again['max_iters']}," in said.out


def test_stopped_runs_exit_with_the_signal_status():
    from codeforge.cli.train import stopped_code
    assert stopped_code({"interrupted": None}) == 0
    assert stopped_code({"interrupted": "SIGINT"}) == 130
    assert stopped_code({"interrupted": "SIGTERM"}) == 143
    # quickstart --chat
    assert stopped_code({"sft": {"interrupted": None}, "tools": {"interrupted": "SIGINT"}}) == 130


def test_options_that_would_be_ignored_are_refused(capsys):
    from codeforge.cli import main
    for argv, said in ((["eval", "--run", "r", "--gguf", "m.gguf"], "give --repo DIR"),
                       (["eval", "--repo", ".", "--gguf", "m.gguf", "--endpoint-api", "completions"],
                        "--endpoint-api completions is for --endpoint URL"),
                       (["quickstart", "--chat", "--base", "none"], "not --chat or --hrm"),
                       (["quickstart", "--lora-rank", "4"], "give --from-hf DIR")):
        assert main(argv) == 2, argv
        assert said in capsys.readouterr().err, argv
