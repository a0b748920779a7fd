"""The one training loop and what it is made of; never imports stages/ or evaluation/ (handed callbacks).

- trainer.py   the loop: stop agreement, evaluate, sample, checkpoint, one optimisation step, log (each
               decides its own cadence)
- stopping.py  stop requests: signals recorded, the step every rank stops at agreed
- optim.py     AdamW groups (fused), Muon + AdamW, learning-rate schedules
- losses.py    log-probs, DPO, Bradley-Terry, GAE, group advantages, clipped policy and value losses
- parallel.py  DDP / FSDP2 wrapping in one place
- logging.py   metrics.jsonl, TensorBoard, W&B, the progress bar
- resume.py    the resume policy: what --resume may change, the data's identity, other numbers of ranks
- memory.py    `codeforge plan`: memory per rank under DDP and FSDP
"""
