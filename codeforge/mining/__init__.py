"""Datasets mined from a code corpus with tree-sitter, each written as JSONL splits and meta.json.

- functions.py  the walk every miner shares: the documented Go and Python functions of each file
- sft.py        `codeforge make-sft`: instruction pairs (signature + doc -> the real function)
- plans.py      `codeforge make-plans`: prompt, statement-skeleton plan and body for the hierarchical model
- pairs.py      `codeforge make-pairs`: the real function against a broken variant, for reward and dpo
- options.py    the options of those three commands, declared once (their flags are made from them)
"""
