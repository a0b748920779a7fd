"""lm-evaluation-harness itself against `codeforge serve`: lm_eval.simple_evaluate with its
`local-completions` model (the legacy OpenAI completions API) over a live server on 127.0.0.1, on two tasks
defined here (tests/lm_eval_tasks/: YAML over local JSONL, nothing downloaded):

  codeforge_mc   multiple choice: lm-eval scores every choice by loglikelihood, one request per
                 (context, " " + choice) with echo, logprobs=1 and max_tokens=1, reading the prompt's
                 token_logprobs past the context (its parse_logprobs);
  codeforge_gen  generate_until: greedy, until "\\n", at most 16 tokens.

Each loglikelihood lm-eval logs (log_samples) must equal codeforge's own scoring in process (the sum of the
log-softmax of the continuation's tokens given the context, over the tokenizer's vocabulary: the padded rows
of the model's vocabulary are never sampled, so they take no probability) within 1e-4, with lm-eval's
is_greedy equal to "every continuation token is the argmax"; each generation must equal Engine.generate at
temperature 0 with the same stop sequences and token budget (what `codeforge generate --temperature 0`
writes).

Tokenization, so the comparison is exact: lm-eval sends token ids (tokenized_requests=True, its default) and
splits context from continuation itself (TemplateLM._encode_pair: trailing whitespace of the context moves to
the continuation; the continuation's tokens are those of context+continuation past the context's), so the
server scores the very ids lm-eval counted and the reference here makes the same split with codeforge's
tokenizer. Two ways lm-eval gets those ids, both run:
  huggingface  tokenizer=<checkpoint>/tokenizer (transformers.AutoTokenizer over the tokenizer.json and
               tokenizer_config.json codeforge writes); asserted here to give codeforge's ids for every text;
  remote       no tokenizer argument: lm-eval finds /tokenizer_info and /tokenize on the server (vLLM's
               endpoints) and tokenizes through them.
The first also sends batches of prompts (batch_size=4), the second one prompt a request.

Run by hand (from the repository root; data_files in the YAML are relative to it):
  lm_eval --model local-completions \\
      --model_args base_url=http://127.0.0.1:8000/v1/completions,model=NAME,max_length=BLOCK_SIZE \\
      --tasks codeforge_mc,codeforge_gen --include_path tests/lm_eval_tasks --log_samples --output_path out
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from codeforge.engine import SamplingParams
from test_serve import base_run, serving  # noqa: F401  (base_run: the tiny trained run fixture, reused)

pytest.importorskip("lm_eval", reason="lm-eval is a dev dependency (pip install -e '.[dev]')")
pytest.importorskip("tenacity",
                    reason="lm-eval's API models need its [api] extra: pip install 'lm-eval[api]'")

TASK_DIR = Path(__file__).parent / "lm_eval_tasks"
REPO = Path(__file__).parent.parent
MAX_GEN_TOKS = 16  # codeforge_gen.yaml's max_gen_toks
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before anything imports datasets
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair for a causal model, with codeforge's tokenizer."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


@torch.inference_mode()
def score(engine, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """(sum of log p(continuation token | everything before it), every continuation token is the argmax),
    the model run directly over context + continuation, log-softmax over the tokenizer's vocabulary."""
    ids = torch.tensor([ctx + cont], device=engine.device)
    logits = engine.model(ids)[0, :, :engine.tok.vocab_size].float()
    lp = torch.log_softmax(logits, -1)[len(ctx) - 1:-1]  # row j predicts cont[j]
    target = torch.tensor(cont, device=engine.device)
    picked = lp.gather(1, target[:, None])[:, 0]
    return float(picked.double().sum()), bool((lp.argmax(-1) == target).all())


def request_args(sample: dict) -> list[tuple]:
    """The (context, continuation) or (context, gen_kwargs) of each request of a logged sample: a list of
    tuples in results["samples"], {"gen_args_0": {"arg_0": context, "arg_1": ...}, ...} once written out."""
    args = sample["arguments"]
    if isinstance(args, dict):
        return [tuple(a[f"arg_{i}"] for i in range(len(a))) for a in args.values()]
    return [tuple(a) for a in args]


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_lm_eval_harness_against_server(base_run, tmp_path, monkeypatch, backend):  # noqa: F811
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "")  # lm-eval sends "Authorization: Bearer $OPENAI_API_KEY"
    monkeypatch.chdir(REPO)  # the YAML's data_files are relative to the repository root
    import datasets
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import check_remote_tokenizer_support
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")

    with serving(base_run) as live:
        eng, tok = live.engine, live.engine.tok
        # max_length: lm-eval keeps context + continuation within max_length - 1 tokens (one is left for the
        # token max_tokens=1 generates); its default (2048) would overrun the tiny model's 64.
        args = dict(base_url=f"{live.url}/v1/completions", model="tiny", max_length=eng.block_size,
                    tokenized_requests=True, max_retries=1, timeout=120)
        if backend == "huggingface":
            args.update(tokenizer_backend="huggingface", tokenizer=str(tok.path), batch_size=4)
        else:  # what lm-eval probes to choose the remote tokenizer by itself (tokenizer_backend=auto)
            assert check_remote_tokenizer_support(args["base_url"]), "no /tokenizer_info and /tokenize"
        lm = get_model("local-completions")(**args)
        assert lm.tokenizer_backend == backend
        out = lm_eval.simple_evaluate(
            model=lm, tasks=["codeforge_mc", "codeforge_gen"],
            task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
            log_samples=True, bootstrap_iters=0, random_seed=0)
        assert out is not None and set(out["results"]) == {"codeforge_mc", "codeforge_gen"}
        samples = out["samples"]

        # -- multiple choice: every choice's loglikelihood and is_greedy -------------------------------------
        mc = samples["codeforge_mc"]
        assert len(mc) == 5
        correct = 0
        for s in mc:
            reqs = request_args(s)
            assert len(reqs) == len(s["doc"]["choices"]) and len(s["resps"]) == len(reqs)
            refs = []
            for (context, continuation), resp in zip(reqs, s["resps"]):
                ll, greedy = resp[0]
                assert lm.tok_encode(context + continuation) == tok.encode(context + continuation)  # same ids
                ctx, cont = encode_pair(tok, context, continuation)
                assert cont and len(ctx) + len(cont) <= eng.block_size - 1  # nothing truncated on either side
                ref_ll, ref_greedy = score(eng, ctx, cont)
                assert math.isclose(float(ll), ref_ll, abs_tol=1e-4), (context, continuation, ll, ref_ll)
                assert greedy in (True, "True") if ref_greedy else greedy in (False, "False"), (
                    context,
                    continuation,
                )
                refs.append(ref_ll)
            correct += max(range(len(refs)), key=refs.__getitem__) == s["doc"]["answer"]
        assert out["results"]["codeforge_mc"]["acc,none"] == pytest.approx(correct / len(mc))

        # -- generate_until: the greedy text, cut at the stop sequences lm-eval sent -------------------------
        gen = samples["codeforge_gen"]
        assert len(gen) == 3
        stop = ["\n"] + [lm.eos_string] * (lm.eos_string not in (None, "\n"))  # lm-eval adds the EOS string
        for s in gen:
            (context, gen_kwargs), = request_args(s)
            assert gen_kwargs["until"] == ["\n"] and gen_kwargs["max_gen_toks"] == MAX_GEN_TOKS
            assert lm.tok_encode(context) == tok.encode(context)
            want = eng.generate([context], SamplingParams(max_new_tokens=MAX_GEN_TOKS, temperature=0.0,
                                                          stop=stop), warn=lambda m: None)[0]
            assert s["resps"] == [[want]], (context, s["resps"], want)
            assert "\n" not in want
