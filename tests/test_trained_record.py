"""Every path that trains records what it trained on (data/trained.py): the document keys it knows, and in
words what it cannot key, so `eval --repo` leaves out every known trained file and calls its score held-out
only when nothing is unknown (issue 56: an imported model's fine-tune recorded nothing, and its score on the
very files it trained on was printed as held-out). One test per path, each a couple of steps of a tiny model.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from codeforge import rundir
from codeforge.checkpoint import find_checkpoint
from codeforge.config import resolve
from codeforge.data.shards import split_digests
from codeforge.data.trained import (recorded, seen_in_training, trained_documents, trained_record,
                                    write_record)
from codeforge.stages import run as run_stage

TINY_MODEL = {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.block_size": 96}
PROMPT = "Write a Python function `pick()` that returns the letter a.\n\n```python\ndef pick():\n```"
GOOD = "def pick():\n    return 'a'\n"
BAD = "def pick():\n    return 'b'\n"


def quiet(m: str) -> None:
    pass


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one thread is fastest on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def cfg_for(data, out, **over):
    """A run of 2 steps; without train.init_from, the tiny model (with it, the starting run's shape)."""
    flags = {"train.batch_size": 2, "train.learning_rate": 3e-3, "train.warmup_steps": 0,
             "train.max_iters": 2, "train.eval_every": 0, "train.eval_tokens": 128, "train.save_every": 0,
             "train.log_every": 1, "train.progress": False, "train.device": "cpu", "train.tensorboard": False,
             "train.loss_chunk_rows": 0, "train.data": str(data), "train.out": str(out)}
    flags.update({k.replace("__", "."): v for k, v in over.items()})
    if "train.init_from" not in flags:
        flags.update(TINY_MODEL)
    return resolve([], None, [], flags, vocab_from_data=True)


def train(data, out, **over) -> list[str]:
    said: list[str] = []
    run_stage(cfg_for(data, out, **over), log=said.append)
    return said


@pytest.fixture(scope="module")
def base(data_dir, tmp_path_factory):
    """A plain run on the test corpus's shards: the starting point of the later stages."""
    out = tmp_path_factory.mktemp("trained") / "base"
    train(data_dir, out)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer_dir):
    """Chat shards, a make-pairs directory and a task file (test_rl.py's 'pick' task)."""
    from codeforge.corpus import CorpusOptions
    from codeforge.data.shards import prepare
    d = tmp_path_factory.mktemp("world")
    convs = [{"messages": [{"role": "user", "content": f"{PROMPT} ({i})"},
                           {"role": "assistant", "content": GOOD if i % 2 else BAD}]} for i in range(40)]
    (d / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    prepare([str(d / "chat.jsonl")], tokenizer_dir, d / "chat", CorpusOptions(val_fraction=0.1),
            log=lambda *a: None, chat=True)
    pairs = [{"prompt": [{"role": "user", "content": PROMPT}],
              "chosen": [{"role": "assistant", "content": GOOD}],
              "rejected": [{"role": "assistant", "content": BAD}]} for _ in range(8)]
    (d / "pairs").mkdir()
    for name in ("train.jsonl", "heldout.jsonl"):
        (d / "pairs" / name).write_text("".join(json.dumps(p) + "\n" for p in pairs))
    tasks = [{"id": f"pick-{i}", "prompt": PROMPT, "tests": "assert pick() == 'a'\n", "solution": GOOD,
              "entry_point": "pick"} for i in range(4)]
    (d / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return d


@pytest.fixture(scope="module")
def imported(tmp_path_factory, tokenizer_dir):
    """`codeforge import --hf` of a tiny random Qwen2 that speaks the test tokenizer: an open model whose
    training data nobody here knows."""
    pytest.importorskip("transformers")
    from codeforge.export.hf import import_hf, write_tokenizer_files
    from codeforge.tokenizer import CodeTokenizer
    from test_export import hf_model
    d = tmp_path_factory.mktemp("hf")
    tok = CodeTokenizer.load(tokenizer_dir)
    hf_model("qwen2", vocab=64 * -(-tok.vocab_size // 64)).save_pretrained(d / "tiny-coder")
    write_tokenizer_files(tokenizer_dir, d / "tiny-coder")
    import_hf(d / "tiny-coder", d / "imported", verify=False, log=quiet)
    return d / "imported"


def test_plain_training_records_its_split_as_complete(base, data_dir):
    r = trained_record(base)
    train_keys, val_keys = split_digests(data_dir, "train"), split_digests(data_dir, "val")
    assert r.complete and r.unknown is None and np.array_equal(r.keys, train_keys)
    assert not np.isin(val_keys, r.keys).any()
    assert np.array_equal(trained_documents(base), train_keys)  # the old reader, for a complete record
    assert recorded(base) and json.loads((base / rundir.TRAINED_INFO).read_text())["unknown"] == []
    assert seen_in_training(base, data_dir, "val") == {"documents": len(val_keys), "trained_on": 0,
                                                       "complete": True, "unknown": None}


def test_init_from_a_recorded_run_adds_its_documents(base, data_dir, tmp_path):
    start = shutil.copytree(base, tmp_path / "start")
    extra = np.array([1, 2, 3], dtype=np.uint64)  # documents the starting run trained on elsewhere
    write_record(start, np.union1d(trained_record(start).keys, extra))
    train(data_dir, tmp_path / "ft", train__init_from=str(find_checkpoint(start, "latest")))  # a checkpoint
    r = trained_record(tmp_path / "ft")
    assert r.complete and np.array_equal(r.keys, np.union1d(split_digests(data_dir, "train"), extra))
    # a starting run that recorded nothing (trained before the records): this run's own split is still
    # recorded, and the record says what is not known (it was dropped whole)
    for name in (rundir.TRAINED, rundir.TRAINED_INFO):
        (start / name).unlink(missing_ok=True)
    train(data_dir, tmp_path / "ft2", train__init_from=str(start))
    r = trained_record(tmp_path / "ft2")
    assert np.array_equal(r.keys, split_digests(data_dir, "train"))
    assert r.reasons == (f"the run {start}: it left no record of what it trained on (trained before "
                         f"codeforge recorded it, or made elsewhere)",)


def test_import_then_full_training_records_its_split_and_the_unknown(imported, data_dir, tmp_path):
    """The issue's path: the imported model's data is unknown, the fine-tune's own split is not."""
    said = train(data_dir, tmp_path / "ft", train__init_from=str(imported))
    r = trained_record(tmp_path / "ft")
    assert np.array_equal(r.keys, split_digests(data_dir, "train")) and not r.complete
    assert r.unknown == "the imported model tiny-coder: what it was trained on is not known"
    assert trained_documents(tmp_path / "ft") is None  # nothing may call a score on these files held-out
    assert any("not everything the model has seen" in m and "tiny-coder" in m for m in said)
    # the imported run itself: nothing known, and said why
    assert not trained_record(imported).complete and len(trained_record(imported).keys) == 0
    # the validation split's overlap can be counted where it is known (a train file is found), never claimed 0
    assert seen_in_training(tmp_path / "ft", data_dir, "val") is None
    assert seen_in_training(tmp_path / "ft", data_dir, "train")["trained_on"] == len(r.keys)


def test_import_then_lora_records_its_split_and_the_unknown(imported, data_dir, tmp_path):
    pytest.importorskip("peft")
    train(data_dir, tmp_path / "lora", train__init_from=str(imported), train__lora_rank=4,
          train__lora_alpha=8)
    r = trained_record(tmp_path / "lora")
    assert np.array_equal(r.keys, split_digests(data_dir, "train"))
    assert r.reasons == ("the imported model tiny-coder: what it was trained on is not known",)
    # its adapter alone, merged back onto the imported weights (`import --adapter`): the base's record, and
    # the adapter's training unknown (an adapter file does not say what it was trained on)
    from codeforge.export.adapter import export_adapter, import_adapter
    export_adapter(tmp_path / "lora", tmp_path / "my-adapter")
    import_adapter(tmp_path / "my-adapter", imported, tmp_path / "merged")
    assert trained_record(tmp_path / "merged").reasons == (
        "the adapter my-adapter: what it was trained on is not known",
        "the imported model tiny-coder: what it was trained on is not known")


def test_sft_records_its_conversations_and_that_they_quote_files(base, world, data_dir, tmp_path):
    train(world / "chat", tmp_path / "sft", train__stage="sft", train__init_from=str(base))
    r = trained_record(tmp_path / "sft")
    want = np.union1d(split_digests(world / "chat", "train"), split_digests(data_dir, "train"))
    assert np.array_equal(r.keys, want) and not r.complete
    assert "the conversations in" in r.unknown and "make-sft" in r.unknown


def test_dpo_keeps_the_starting_record_and_says_the_pairs_are_not_keyed(base, world, tmp_path):
    train(world / "pairs", tmp_path / "dpo", train__stage="dpo", train__init_from=str(base),
          train__max_iters=1)
    r = trained_record(tmp_path / "dpo")
    assert np.array_equal(r.keys, trained_record(base).keys) and not r.complete
    assert r.unknown.startswith(f"the preference pairs in {world / 'pairs'}")


def test_grpo_carries_the_starting_record_whole(base, world, tmp_path):
    """The policy's targets are its own samples: the record is the starting run's, what it does not know
    included (here a DPO run's pairs)."""
    if shutil.which("bwrap") is None:
        pytest.skip("execution rewards run in bubblewrap (apt-get install bubblewrap)")
    start = tmp_path / "start"
    train(world / "pairs", start, train__stage="dpo", train__init_from=str(base), train__max_iters=1)
    train(world / "tasks.jsonl", tmp_path / "grpo", train__stage="grpo", train__init_from=str(start),
          train__max_iters=1, train__group_size=2, train__rollout_tasks=1, train__rollout_tokens=8,
          train__ppo_epochs=1, train__eval_tasks=1)
    r, before = trained_record(tmp_path / "grpo"), trained_record(start)
    assert np.array_equal(r.keys, before.keys) and len(r.keys) and r.reasons == before.reasons


def test_hrm_records_that_its_plans_are_not_keyed(tokenizer_dir, tmp_path):
    from test_hrm import _cfg, records
    plans = tmp_path / "plans"
    plans.mkdir()
    (plans / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(8)))
    run_stage(_cfg(plans, tokenizer_dir, tmp_path / "hrm", **{"train.max_iters": 1}), log=quiet)
    r = trained_record(tmp_path / "hrm")
    assert len(r.keys) == 0 and r.unknown.startswith(f"the plans in {plans}")


def test_a_record_cut_short_or_from_before_is_read_safely(base, tmp_path):
    """A record from before the .json (only complete ones were written then) stays complete; a pair of files
    that do not match is incomplete and not taken as recorded (a resume writes it again); a run without
    any record says so."""
    old = tmp_path / "old"
    old.mkdir()
    np.save(old / rundir.TRAINED, np.array([5, 7], dtype=np.uint64))
    assert trained_record(old).complete and trained_record(old).keys.tolist() == [5, 7]
    write_record(tmp_path / "cut", np.array([1, 2], dtype=np.uint64))
    np.save(tmp_path / "cut" / rundir.TRAINED, np.array([1], dtype=np.uint64))
    r = trained_record(tmp_path / "cut")
    assert not r.complete and "do not match" in r.unknown and r.keys.tolist() == [1]
    assert not recorded(tmp_path / "cut")
    (tmp_path / "none").mkdir()
    assert "left no record" in trained_record(tmp_path / "none").unknown
