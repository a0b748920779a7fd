"""Everything the Trainer calls next() on, and the files behind it.

- shards.py       `codeforge prepare` (code through pipeline.py; chat here, with loss masks) and ShardSet,
                  the reader of the shards
- pipeline.py     prepare as a datatrove pipeline: the plan, the stages in order, local or Slurm
- steps.py        the pipeline's steps: read, quality filters, exact/near dedup signatures, benchmarks out,
                  secrets replaced, encode, merge; the counts each keeps
- fork_server.py  the fork server the local pools fork from, started as the command begins
- warm_scans.py   imported by that fork server: the secrets step's Hyperscan databases compiled there once
- local.py        the local executor: a process pool whose workers end with the command, the engine's console
                  output kept off the terminal
- slurm.py        the Slurm executor: one job array per stage, every path in the job scripts quoted
- ray_executor.py the Ray executor (`--executor ray`): each stage's tasks as Ray actors, a failed task fails
                  its stage
- workdir.py      prepare's work directory: this user's alone, its lock, the plan checked against the inputs
- writer.py       token ids -> shard files, repo-level FIM documents, the meta.json report
- loader.py       packed (B, T) batches from shards; conversation rows with masked targets; resumable cursors
- hrm_batches.py  the hierarchical model's batches from mined plans, damaged drafts labelled by the parser
- pairs.py        preference pairs (reward, dpo): encoded sides, a seeded shuffle per epoch, a cursor
- trained.py      what a run trained on: the training split's identity and the documents a run has seen
- options.py      the options of tokenizer train|eval, prepare and data info, declared once (their flags
                  are made from them); the corpus options are corpus.py's
"""
