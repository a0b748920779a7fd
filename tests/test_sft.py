"""Chat SFT and tool calling end to end on the CPU: chat shards with loss masks, the conversation loader,
the sft stage through the same Trainer (resume exactness like pretraining's), the CLI (make-sft, make-tools,
prepare --chat, train --stage sft, chat from stdin, eval --json on a chat run)."""

import io
import json
import os
import signal

import pytest
import torch

from codeforge import CodeforgeError
from codeforge.cli import main
from codeforge.config import resolve
from codeforge.data.loader import ChatBatchLoader
from codeforge.data.shards import ShardSet, prepare
from codeforge.stages import run as run_stage
from codeforge.tokenizer import CodeTokenizer

CONV = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."},
                     {"role": "assistant", "content": "5"}]}


def long_conversation(turns: int) -> dict:
    msgs = []
    for i in range(turns):
        msgs += [{"role": "user", "content": f"question {i}: " + "word " * 6},
                 {"role": "assistant", "content": f"answer {i}: " + "reply " * 6}]
    return {"messages": msgs}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory, tokenizer_dir):
    from codeforge.corpus import CorpusOptions
    from codeforge.tasks.tool_calls import generate
    d = tmp_path_factory.mktemp("chat")
    rows = [CONV, long_conversation(12), {"messages": [{"role": "user", "content": "x " * 400},
                                                       {"role": "assistant", "content": "y"}]}]
    rows += generate(120, seed=1)
    rows += [{"messages": [{"role": "user", "content": f"Write f{i}."},
                           {"role": "assistant", "content": f"def f{i}():\n    return {i}\n"}]}
             for i in range(150)]
    src = d / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = d / "data"
    meta = prepare([str(src)], tokenizer_dir, out, CorpusOptions(val_fraction=0.1), log=lambda *a: None,
                   chat=True)
    return out, meta


def test_chat_shards_and_masked_loader(chat_data, tokenizer_dir):
    out, meta = chat_data
    assert meta["chat"] and meta["loss_tokens"]["train"] > 0
    ss = ShardSet(out, "train")
    assert ss.chat and len(ss.masks) == len(ss.arrays)
    tok = CodeTokenizer.load(tokenizer_dir)
    T = 64
    ld = ChatBatchLoader(ss, 4, T, tok.special_ids["<|im_start|>"], tok.special_ids["<pad>"], seed=0)
    # the 12-turn conversation is split at turn boundaries; the one with a 400-word user turn is dropped
    assert ld.split >= 1 and ld.dropped >= 1
    assert all(b - a <= T + 1 for a, b in ld.pieces.tolist())
    im_start = tok.special_ids["<|im_start|>"]
    for a, b in ld.pieces.tolist():  # every piece starts a turn: never cut mid-turn
        ids, _ = ss.span(a, b)
        assert ids[0] == im_start
    x, y = ld.next_batch()
    assert x.shape == y.shape == (4, T)
    counted = y[y != -1]
    assert len(counted) > 0
    # targets are exactly the assistant-written tokens: decoding them never shows a role header
    text = tok.decode(counted.tolist())
    assert "user\n" not in text and "<|im_start|>" not in text
    # resumable cursor
    st = ld.state_dict()
    nxt = ld.next_batch()
    ld2 = ChatBatchLoader(ss, 4, T, im_start, tok.special_ids["<pad>"], seed=0)
    ld2.load_state_dict(st)
    assert all(torch.equal(p, q) for p, q in zip(nxt, ld2.next_batch()))


def cfg_for(data, out, **over):
    flags = {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.block_size": 64,
             "train.batch_size": 4, "train.learning_rate": 3e-3, "train.warmup_steps": 2,
             "train.eval_every": 4,
             "train.eval_tokens": 128, "train.save_every": 4, "train.log_every": 1, "train.progress": False,
             "train.device": "cpu", "train.data": str(data), "train.out": str(out)}
    flags.update({k.replace("__", "."): v for k, v in over.items()})
    return resolve([], None, [], flags, vocab_from_data=True)


def losses(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_sft_stage_resume_equals_straight_and_stage_checks(chat_data, data_dir, tmp_path, monkeypatch):
    out, _ = chat_data
    run_stage(cfg_for(data_dir, tmp_path / "base", train__max_iters=4), log=lambda m: None)
    over = dict(train__stage="sft", train__max_iters=10, train__init_from=str(tmp_path / "base"),
                model__resid_dropout=0.1)
    run_stage(cfg_for(out, tmp_path / "a", **over), log=lambda m: None)
    straight = losses(tmp_path / "a")
    import codeforge.train.trainer as tr
    real = tr.Trainer._optimisation_step

    def step_then_signal(self):
        r = real(self)
        if self.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return r

    monkeypatch.setattr(tr.Trainer, "_optimisation_step", step_then_signal)
    r = run_stage(cfg_for(out, tmp_path / "b", **over), log=lambda m: None)
    assert r["interrupted"] == "SIGTERM" and r["step"] == 6
    monkeypatch.setattr(tr.Trainer, "_optimisation_step", real)
    run_stage(cfg_for(out, tmp_path / "b", **over), resume=True, log=lambda m: None)
    resumed = losses(tmp_path / "b")
    assert sorted(resumed) == sorted(straight) == list(range(1, 11))
    assert all(resumed[s] == straight[s] for s in straight)
    # the chat template travels with every stage's checkpoint tokenizer
    final = (tmp_path / "b" / "checkpoints" / "final").read_text().strip()
    cfg_json = json.loads(
        (tmp_path / "b" / "checkpoints" / final / "tokenizer" / "tokenizer_config.json").read_text()
    )
    assert "<|im_start|>" in cfg_json["chat_template"]
    with pytest.raises(CodeforgeError, match="holds plain text shards"):
        run_stage(cfg_for(data_dir, tmp_path / "c", train__stage="sft"), log=lambda m: None)
    with pytest.raises(CodeforgeError, match="holds chat data"):
        run_stage(cfg_for(out, tmp_path / "d"), log=lambda m: None)


def test_stage_defaults_and_best_by_name(tmp_path):
    assert resolve([], None, [], {"train.stage": "sft"}).train.learning_rate == 5e-5  # seed 004
    assert resolve([], None, [], {"train.stage": "tools"}).train.learning_rate == 3e-6  # seed 003
    assert (
        resolve([], None, [], {"train.stage": "sft", "train.learning_rate": 1e-3}).train.learning_rate == 1e-3
    )
    from codeforge.checkpoint import CheckpointError, find_checkpoint
    ck = tmp_path / "r" / "checkpoints" / "step_000002"
    ck.mkdir(parents=True)
    (ck / "model.safetensors").write_bytes(b"x")
    (tmp_path / "r" / "checkpoints" / "latest").write_text("step_000002\n")
    with pytest.raises(CheckpointError, match="has no 'best' checkpoint"):
        find_checkpoint(tmp_path / "r", "best")
    assert find_checkpoint(tmp_path / "r", "auto") == ck


def test_cli_chat_pipeline(tmp_path, tokenizer_dir, data_dir, capsys, monkeypatch):
    """make-sft and make-tools -> prepare --chat -> train --stage sft from a pretrained run -> chat on stdin
    -> eval --json with the tool-calling scores."""
    src = tmp_path / "code"
    src.mkdir()
    (src / "m.py").write_text("".join(
        f'def add_{i}(a, b):\n    """Return the sum of a and b plus {i}."""\n    return a + b + {i}\n\n\n'
        for i in range(40)))
    assert main(["make-sft", "--input", str(src), "--out", str(tmp_path / "pairs"), "--heldout-fraction",
                 "0.1"]) == 0
    assert "mined" in capsys.readouterr().out
    assert main(["make-sft", "--input", str(src), "--out", str(tmp_path / "pairs")]) == 2  # never overwritten
    assert "--overwrite" in capsys.readouterr().err
    assert main(["make-tools", "--out", str(tmp_path / "tools"), "--count", "60", "--heldout", "10"]) == 0
    tools_file = tmp_path / "tools" / "tools.json"  # the tools' schemas, for chat --tools
    assert "tools.json" in capsys.readouterr().out
    assert {t["function"]["name"] for t in json.loads(tools_file.read_text())} == set(
        json.loads((tmp_path / "tools" / "meta.json").read_text())["tools"])
    assert main(["prepare", "--chat", "--input", str(tmp_path / "pairs" / "train.jsonl"),
                 str(tmp_path / "tools" / "train.jsonl"), "--tokenizer", str(tokenizer_dir), "--out",
                 str(tmp_path / "cd"), "--val-fraction", "0.1"]) == 0
    capsys.readouterr()
    small = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "256", "--batch-size", "2",
             "--no-progress", "--device", "cpu", "--eval-tokens", "128"]
    assert main(["train", "--data", str(data_dir), "--out", str(tmp_path / "base"), "--max-iters", "2",
                 *small]) == 0
    # --init-from takes the model shape from the checkpoint: no model flags needed for the next stage
    assert main(["train", "--stage", "sft", "--data", str(tmp_path / "cd"), "--out", str(tmp_path / "sft"),
                 "--init-from", str(tmp_path / "base"), "--max-iters", "3", "--learning-rate", "1e-3",
                 "--no-progress", "--device", "cpu", "--eval-tokens", "128"]) == 0
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("Write a function that adds two numbers."))
    assert main(["chat", "--run", str(tmp_path / "sft"), "--max-new-tokens", "8", "--seed", "0"]) == 0
    monkeypatch.setattr("sys.stdin",
                        io.StringIO(json.dumps({"messages": [{"role": "robot", "content": "x"}]})))
    assert main(["chat", "--run", str(tmp_path / "sft")]) == 2
    assert "unknown_role" in capsys.readouterr().err
    # a tools-stage run offered no tools answers in text, and chat says why; offered the file, no note
    assert main(["train", "--stage", "tools", "--data", str(tmp_path / "cd"), "--out", str(tmp_path / "tl"),
                 "--init-from", str(tmp_path / "sft"), "--max-iters", "1", "--no-progress", "--device", "cpu",
                 "--eval-tokens", "128"]) == 0
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("Read the file a.py"))
    assert main(["chat", "--run", str(tmp_path / "tl"), "--max-new-tokens", "8", "--seed", "0"]) == 0
    said = capsys.readouterr()
    assert (
        "trained to call tools, but none are offered" in said.err and "[unparsed tool call]" not in said.out
    )
    monkeypatch.setattr("sys.stdin", io.StringIO("Read the file a.py"))
    assert main(["chat", "--run", str(tmp_path / "tl"), "--tools", str(tools_file), "--max-new-tokens",
                 "8"]) == 0
    assert "none are offered" not in capsys.readouterr().err
    assert main(["eval", "--run", str(tmp_path / "sft"), "--json", "--tool-cases", "4", "--eval-tokens",
                 "128"]) == 0
    said = capsys.readouterr()
    r = json.loads(said.out)
    assert r["chat"] is True and r["tool_cases"] == 4 and r["val_loss"] > 0
    # the tokens read and the ones scored are told apart: only the replies count
    assert "validation loss on the val split's replies (up to 128 tokens read" in said.err
    assert 0 < r["eval_tokens"] < 128
    for k in ("tool_parse_rate", "tool_name_accuracy", "tool_args_exact", "no_call_accuracy",
              "tool_im_end_rate"):
        assert k in r
