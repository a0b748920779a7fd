"""Everything the Trainer calls next() on, and the files behind it.

- shards.py       documents -> token shards (`codeforge prepare`; chat: plus loss masks); ShardSet reads them
- loader.py       packed (B, T) batches from shards; conversation rows with masked targets; resumable cursors
- hrm_batches.py  the hierarchical model's batches from mined plans, damaged drafts labelled by the parser
- pairs.py        preference pairs (reward, dpo): encoded sides, a seeded shuffle per epoch, a cursor
"""
