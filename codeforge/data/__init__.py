"""Everything the Trainer calls next() on, and the files behind it.

- shards.py       `codeforge prepare` (code through pipeline.py; chat here, plus
                  loss masks); ShardSet reads shards
- pipeline.py     prepare as a datatrove pipeline: plan, read, exact/near dedup, encode, merge; local or Slurm
- writer.py       token ids -> shard files, repo-level FIM documents, the meta.json report
- loader.py       packed (B, T) batches from shards; conversation rows with masked targets; resumable cursors
- hrm_batches.py  the hierarchical model's batches from mined plans, damaged drafts labelled by the parser
- pairs.py        preference pairs (reward, dpo): encoded sides, a seeded shuffle per epoch, a cursor
"""
