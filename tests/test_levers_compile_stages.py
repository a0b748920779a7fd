"""A stage whose batches change shape (DPO pairs are padded to each batch's longest pair) trains under
--compile on whatever --compile-shapes says: the static whole graph (the default on CUDA) is for the LM
stages' fixed (B, T) batches only, and a static graph that meets torch's recompile limit anyway falls back to
dynamic shapes. The backend is swapped for dynamo's "eager" (the limit is dynamo's, before any backend) to
keep it fast."""

import json

import pytest

from codeforge.config import resolve
from codeforge.stages import run as run_stage
from codeforge.train import parallel

PROMPT = "Write a Python function `pick()` that returns the letter a."


def conv(answer):
    return {"messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": answer}]}


def cfg_for(data, out, **over):
    flags = {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 128,
             "train.batch_size": 1, "train.learning_rate": 1e-3, "train.warmup_steps": 0,
             "train.eval_every": 0, "train.save_every": 0, "train.log_every": 1, "train.progress": False,
             "train.device": "cpu", "train.tensorboard": False, "train.data": str(data),
             "train.out": str(out)}
    flags.update({k.replace("__", "."): v for k, v in over.items()})
    return resolve([], None, [], flags, vocab_from_data=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer_dir):
    from codeforge.corpus import CorpusOptions
    from codeforge.data.shards import prepare
    d = tmp_path_factory.mktemp("dpo")
    (d / "chat.jsonl").write_text("".join(json.dumps(conv("return 'a'" * (1 + i % 3))) + "\n"
                                          for i in range(40)))
    prepare([str(d / "chat.jsonl")], tokenizer_dir, d / "data", CorpusOptions(val_fraction=0.0, dedup="none"),
            log=lambda *a: None, chat=True)
    run_stage(cfg_for(d / "data", d / "sft", train__stage="sft", train__max_iters=2), log=lambda m: None)
    # pairs of 12 different lengths: every batch of one pair has its own padded length
    pairs = [{"prompt": [{"role": "user", "content": PROMPT}],
              "chosen": [{"role": "assistant", "content": "x = 1\n" * (1 + i)}],
              "rejected": [{"role": "assistant", "content": "y = 2\n" * (1 + i)}]} for i in range(12)]
    (d / "pairs").mkdir()
    (d / "pairs" / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return d


@pytest.mark.parametrize("compile,shapes", [("off", "static"), ("on", "dynamic"), ("on", "static")])
def test_dpo_with_a_static_compile_trains_as_without(world, tmp_path, monkeypatch, compile, shapes):
    real = parallel.compiled
    monkeypatch.setattr(parallel, "compiled", lambda m, static=True, say=print, backend="inductor":
                        real(m, static, say, "eager"))
    r = run_stage(cfg_for(world / "pairs", tmp_path / f"{compile}-{shapes}", train__stage="dpo",
                          train__init_from=str(world / "sft"), train__max_iters=12, train__compile=compile,
                          train__compile_shapes=shapes),
                  log=lambda m: None)
    assert r["step"] == 12
