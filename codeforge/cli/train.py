"""Training commands: train (every stage), plan (memory per rank), presets, config keys, quickstart."""

from __future__ import annotations

import argparse
import os
import sys

from .. import rundir
from .args import CLIError


CONFIG_COMMANDS = ("train", "plan")  # the commands whose flags are generated from the config fields


def add_parsers(sub, config_flags: bool = True) -> None:

    t = sub.add_parser("train", help="train a model on prepared shards (any stage)",
                       usage="codeforge train --data DIR --out RUN [--stage S] [--preset NAME ...] "
                             "[--resume] [options]",
                       description="Every config field is a flag (generated from its declaration "
                                   "in config.py and models/gpt.py); precedence, later wins: "
                                   "defaults < --stage defaults < --preset < --config < --set < flags.")
    t.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    if config_flags:
        _config_flags(t)
    t.set_defaults(func=cmd_train)
    pl = sub.add_parser("plan",
                        help="memory per rank (parameters, gradients, optimizer state, activations) under "
                             "DDP and FSDP, before launching",
                        usage="codeforge plan --preset NAME [--world-size N] "
                              "[--gpu-memory GIB] [train options]",
                        description="An estimate from the model's shapes and the training settings (the same "
                                    "presets, --set and flags as `train`); benchmarks/fsdp_memory.py checks "
                                    "it against measured peaks.")
    pl.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks (all nodes together)")
    pl.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                    help="memory of one device, to say what fits (default: this machine's GPU, if any)")
    if config_flags:
        _config_flags(pl)
    pl.set_defaults(func=cmd_plan)
    p = sub.add_parser("presets", help="list model presets (with parameter counts) and hardware profiles")
    p.add_argument("--write-catalog", action="store_true",
                   help="(for developers) recompute codeforge/presets/catalog.json "
                        "after changing models.toml")
    p.set_defaults(func=cmd_presets)
    c = sub.add_parser("config", help="`config keys`: every settable key (--set KEY=VALUE, config files)")
    c.add_argument("what", choices=["keys"], help="keys: list every settable key")
    c.set_defaults(func=cmd_config_keys)


def _config_flags(t) -> None:
    """--preset, --config, --set, --dropout and a flag per config field."""
    from ..config import SECTIONS
    from ..fields import add_flags
    t.add_argument("--preset", nargs="+", action="extend", default=[], metavar="NAME",
                   help="model and/or hardware presets, applied in order (see `codeforge presets`)")
    t.add_argument("--config", help="TOML or YAML file with [model] and [train] tables")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config field, e.g. --set train.warmup_steps=50 "
                        "(`codeforge config keys` lists them)")
    t.add_argument("--dropout", type=float, default=None,
                   help="sets embedding, attention and residual dropout")
    for section, cls in SECTIONS.items():
        add_flags(t, cls, group=f"{section} settings", dest_prefix=f"{section}.", given_only=True)


def cmd_config_keys(a: argparse.Namespace) -> int:
    from dataclasses import fields

    from ..config import COMMON_SECTIONS, SECTION_OF_KIND, SECTIONS, STAGE_TABLE
    from ..fields import describe, flag_name

    def show(section: str, cls) -> None:
        for f in fields(cls):
            flag = flag_name(f) if f.metadata.get("cli", True) else "(config file or --set only)"
            print(f"  {section}.{f.name:22s} {type(f.default).__name__:5s} {flag:24s} {describe(f)}")
    print("[model]")
    show("model", SECTIONS["model"])
    print("[train]  (one table in config files: the settings every stage reads, by the component that reads "
          "them, then each stage kind's own)")
    for name, cls in COMMON_SECTIONS.items():
        doc = " ".join(cls.__doc__.split())  # the component's docstring names the module that reads it
        print(f"  # {name}: {doc[0].lower()}{doc[1:]}")
        show("train", cls)
    for kind, cls in SECTION_OF_KIND.items():
        stages = ", ".join(st.name for st in STAGE_TABLE if st.kind == kind)
        print(f"  # --stage {stages}")
        show("train", cls)
    return 0


def _train_config(a: argparse.Namespace):
    from ..config import load_file, resolve
    flags = {k: v for k, v in vars(a).items() if k.startswith(("model.", "train.")) and v is not None}
    if a.dropout is not None:
        flags.update({"model.embd_dropout": a.dropout, "model.attn_dropout": a.dropout,
                      "model.resid_dropout": a.dropout})
    out = flags.get("train.out")
    if not out:
        raise CLIError("train needs --out RUN (the run directory), and --data DIR (from `codeforge prepare`) "
                       "unless it resumes a run")
    saved = os.path.join(out, rundir.CONFIG)
    base = None
    if a.resume and os.path.exists(saved):
        base = load_file(saved)  # the saved run (its data, stage, model), then this command's changes
    elif not flags.get("train.data"):
        raise CLIError("train needs --data DIR (from `codeforge prepare`)" + (
            f"; --resume found no run to continue at {out} (no {rundir.CONFIG})" if a.resume else ""))
    return resolve(a.preset, a.config, a.set, flags, base=base, vocab_from_data=True)


def _preset_advice(presets: list[str], cfg) -> None:
    """A model preset chosen alone for a CPU run gets the default optimizer and learning rate, not the CPU
    recipe a hardware profile adds (the quickstart uses both): say so."""
    from ..config import preset_names
    from ..device import choose_device
    names = preset_names()
    if not presets or any(p in names["train"] for p in presets) or cfg.train.stage != "pretrain":
        return
    if choose_device(cfg.train.device)[0].type == "cpu":
        print(f"note: --preset {' '.join(presets)} sets the model's shape only; on a CPU, the recipe the "
              "quickstart trains with (optimizer, learning rate, batch) comes with a hardware profile too: "
              f"--preset {' '.join(presets)} lowend-cpu (`codeforge presets` lists them)", file=sys.stderr)


def cmd_plan(a: argparse.Namespace) -> int:
    import torch

    from ..config import resolve
    from ..train.memory import estimate, report
    if a.world_size < 1:
        raise CLIError(f"--world-size {a.world_size}: give the number of ranks, 1 or more")
    if a.gpu_memory is not None and a.gpu_memory <= 0:
        raise CLIError(f"--gpu-memory {a.gpu_memory}: give one device's memory in GiB, e.g. 24")
    flags = {k: v for k, v in vars(a).items() if k.startswith(("model.", "train.")) and v is not None}
    cfg = resolve(a.preset, a.config, a.set, flags)
    if cfg.model.vocab_size == 0:  # from the data's tokenizer, as train does
        if not cfg.train.data:
            raise CLIError("plan needs the vocabulary size: a model --preset, --vocab-size N, or --data DIR "
                           "(prepared data; its tokenizer gives it)")
        from dataclasses import replace

        from ..stages.common import round_up
        from ..tokenizer import CodeTokenizer
        tok = CodeTokenizer.load(os.path.join(cfg.train.data, "tokenizer"))
        cfg = replace(cfg, model=replace(cfg.model, vocab_size=round_up(tok.vocab_size, 64)))
    gpu = a.gpu_memory * 2**30 if a.gpu_memory else (
        torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None)
    from ..device import cpu_native_bf16
    from ..stages.local import resolve_auto
    # --local-ranks 0 (the lowend-cpu profile's): the processes and batch this machine gets
    cfg = resolve_auto(cfg)
    t = cfg.train
    on_cpu = t.device == "cpu" or not gpu
    precision = t.precision if t.precision not in ("auto", "fastest") else (
        ("bf16" if t.precision == "fastest" and cpu_native_bf16() else "fp32") if on_cpu else "bf16")
    world = a.world_size if a.world_size > 1 else max(1, t.local_ranks)  # --local-ranks N: N processes here
    plan = estimate(cfg.model, t, world, precision, t.fsdp_offload)
    print(report(plan, cfg.model, t, precision, gpu, " + ".join(a.preset)))
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from ..stages import run
    cfg = _train_config(a)
    _preset_advice(a.preset, cfg)
    r = run(cfg, resume=a.resume)
    if os.environ.get("RANK", "0") != "0":
        return 0
    msg = f"{'stopped' if r.get('interrupted') else 'done'}: step {r['step']}, {r['tokens']:,} tokens"
    when = "" if r.get("val_step") == r["step"] else f" (evaluated at step {r['val_step']})"
    if r.get("evaluation"):  # preference and RL stages say what they measured
        msg += f"; {r['evaluation']}{when}"
    elif r["val_loss"] is not None:
        msg += f", val loss {r['val_loss']:.4f}{when}"
    print(msg + f"; run directory {r['run_dir']}")
    return stopped_code(r)


def cmd_presets(a: argparse.Namespace) -> int:
    """The presets from the shipped catalog (no torch: an answer in a blink); when models.toml no longer
    matches it (edited in place), computed afresh. --write-catalog rewrites it (tests check it is current)."""
    import tomllib
    from importlib import resources

    from ..catalog import shipped_catalog
    if a.write_catalog:
        from ..config import write_catalog
        print(f"wrote {write_catalog()}")
        return 0
    cat = shipped_catalog()
    if cat is None:  # models.toml edited in place: computed afresh (this needs torch)
        from ..config import preset_catalog
        cat = preset_catalog()
    base = resources.files("codeforge.presets")
    print(f"{'model preset':20s} {'params':>14s} {'layers':>6s} {'heads':>5s} {'kv':>3s} {'width':>6s} "
          f"{'ffn':>6s} {'ctx':>6s} {'vocab':>6s}  arch")
    for n, m in sorted(cat["presets"].items()):
        print(f"{n:20s} {m['params']:14,d} {m['n_layer']:6d} {m['n_head']:5d} {m['n_kv_head']:3d} "
              f"{m['n_embd']:6d} {m['ffn_hidden']:6d} {m['block_size']:6d} {m['vocab_size']:6d}  {m['kind']}")
    print("hardware profiles: "
          + ", ".join(sorted(tomllib.loads(base.joinpath("hardware.toml").read_text()))))
    return 0


def add_quickstart_parser(sub) -> None:
    from ..fields import add_flags
    from ..quickstart.options import QuickstartOptions  # no torch: the parser of every command has this one
    q = sub.add_parser("quickstart", help="the whole pipeline on your code (a directory) or a corpus this "
                                          "machine has (Python's or Go's standard library): tokenizer, "
                                          "prepare, train, eval, sample")
    add_flags(q, QuickstartOptions)
    q.set_defaults(func=cmd_quickstart)


NAMED_CORPORA = ("python-stdlib", "go")


def check_corpus(corpus: str) -> None:
    """A --corpus that is neither a named corpus nor a path is refused before the quickstart's imports (torch
    and the rest: seconds), with the name it was probably meant to be."""
    if corpus in NAMED_CORPORA or os.path.exists(os.path.expanduser(corpus)):
        return
    import difflib
    near = difflib.get_close_matches(corpus, NAMED_CORPORA, n=1)
    raise CLIError(f"--corpus {corpus!r}: not {' or '.join(NAMED_CORPORA)}, nor an existing directory"
                   + (f" (did you mean {near[0]}?)" if near else ""))


def cmd_quickstart(a: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ..fields import from_args
    from ..quickstart.options import QuickstartOptions
    opts = from_args(QuickstartOptions, a, "quickstart", out=a.out or default_out(a.corpus, a.chat, a.hrm))
    check_corpus(opts.corpus)
    opts.recipe()  # flags that contradict each other, refused before the quickstart's imports too
    from ..quickstart import RESUME, run_quickstart
    from ..train.stopping import RESUME_HINT
    # training's ranks, processes of their own too, say the same way on; for this command only (a caller in
    # the same process, a test or a script, trains on with its own)
    before = os.environ.get(RESUME_HINT)
    os.environ[RESUME_HINT] = RESUME
    try:
        r = run_quickstart(**asdict(opts), base_dir=default_out(opts.corpus) if opts.chat else None)
    except FileNotFoundError as e:
        raise CLIError(str(e)) from e
    finally:
        if before is None:
            os.environ.pop(RESUME_HINT, None)
        else:
            os.environ[RESUME_HINT] = before
    return stopped_code(r)


def default_out(corpus: str, chat: bool = False, hrm: bool = False) -> str:
    """runs/quickstart (-chat, -hrm) for the Python standard library; another corpus gets its own directory
    beside it (runs/quickstart-go, runs/quickstart-NAME for a directory NAME), so its tokenizer, shards and
    run never land in another corpus's."""
    name = "quickstart" + ("-chat" if chat else "-hrm" if hrm else "")
    if corpus != "python-stdlib":
        tail = os.path.basename(os.path.realpath(os.path.expanduser(corpus))) or "corpus"
        name += "-" + ("".join(c if c.isalnum() or c in "-_." else "_" for c in tail).lstrip(".") or "corpus")
    return os.path.join("runs", name)


def stopped_code(r: dict) -> int:
    """The exit status of a run stopped by a signal (Ctrl-C: 130, SIGTERM: 143, as a shell reports them), so
    a script can tell it from a finished run; 0 when it finished. Looks into the stages a result holds."""
    import signal
    found = [r.get("interrupted")] + [v.get("interrupted") for v in r.values() if isinstance(v, dict)]
    name = next((x for x in found if x), None)
    if not name:
        return 0
    try:
        return 128 + int(signal.Signals[name])
    except KeyError:
        return 130
