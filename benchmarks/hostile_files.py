"""Small hostile files must not cost large memory, time or secrets. Each case builds one hostile input in a
temporary directory (a few KB on disk: an edited config.json with its manifest hashed again, a FIFO, a link,
garbage bytes, a sparse file) and runs the codeforge command a user would run on it, in a child process with a
time limit and an address-space cap (RLIMIT_AS), so the code before the fix fails fast instead of taking the
machine. It prints, per case: peak RSS (the child's ru_maxrss, from wait4), seconds and the outcome: a clear
error (exit 2, one `error:` line), a traceback, "hit the cap" (an allocation refused at the RLIMIT_AS cap),
a hang (killed at the time limit), or accepted (exit 0; "secret copied" when a file from outside the input
landed in the output).

    git worktree add /tmp/cf-old a0c5882
    python benchmarks/hostile_files.py --code-dir /tmp/cf-old       # the code before the fix
    python benchmarks/hostile_files.py                              # this checkout
    python benchmarks/hostile_files.py --before /tmp/cf-old         # both, one table: before | after

Cases are two lists of Case(name, build, leaked): `build(dir, base)` writes the
input under the empty `dir` and
returns the codeforge argv to run; `base` holds a tokenizer, prepared data, a
2-step training run and a Hugging
Face export of a tiny model, built once per invocation with this checkout's code. CHECKPOINT_CASES cover
checkpoints, run directories and `import --hf`; CORPUS_CASES (below, kept apart) are the corpus readers'.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SECRET = "AWS_SECRET_ACCESS_KEY=hostile-files-benchmark"
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "2",
        "--eval-every", "0", "--device", "cpu", "--no-progress", "--no-tensorboard"]


def codeforge(*args: str, code: Path = HERE) -> None:
    """Run codeforge (of checkout `code`) to build an input; any failure ends the benchmark."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    r = subprocess.run([sys.executable, "-m", "codeforge", *args], env=env, capture_output=True, text=True,
                       cwd=tempfile.gettempdir())
    if r.returncode:
        raise SystemExit(f"building the inputs: codeforge {' '.join(args)} failed:\n{r.stderr[-3000:]}")


class Base:
    """What the cases start from, built once: a tokenizer, prepared data, a
    trained run, a Hugging Face dir."""

    def __init__(self, root: Path):
        self.root = root
        self.tokenizer = root / "tok"
        self.data = root / "data"
        self.run = root / "run"  # 2 steps of a 1-layer model: checkpoints/step_000002 with its full state
        self.hf = root / "hf"  # a Llama-family export of a tiny model
        src = [str(STDLIB / "json")]
        codeforge("tokenizer", "train", "--input", *src, "--vocab-size", "300", "--out", str(self.tokenizer))
        codeforge("prepare", "--input", *src, "--tokenizer", str(self.tokenizer), "--out", str(self.data),
                  "--val-fraction", "0.1")
        codeforge("train", "--data", str(self.data), "--out", str(self.run), "--max-iters", "2",
                  "--save-every", "2", *TINY)
        llama = root / "llama"
        codeforge("train", "--data", str(self.data), "--out", str(llama), "--max-iters", "1", *TINY, "--pos",
                  "rope", "--norm", "rmsnorm", "--mlp", "swiglu", "--no-bias")
        codeforge("export", "--run", str(llama), "--format", "hf", "--out", str(self.hf), "--no-verify")

    def copy_run(self, d: Path) -> tuple[Path, Path]:
        """(a copy of the trained run under d, its checkpoint)."""
        shutil.copytree(self.run, d / "run", symlinks=True)
        return d / "run", d / "run" / "checkpoints" / "step_000002"

    def copy_hf(self, d: Path) -> Path:
        shutil.copytree(self.hf, d / "hf", symlinks=True)
        return d / "hf"


# -- what an attacker does to a checkpoint -------------------------------------------------------------------

def rehash(ck: Path) -> None:
    """Write the manifest again over the edited files: anyone can (the manifest is a
    checksum, not a signature)."""
    files = {f.relative_to(ck).as_posix(): f for f in sorted(ck.rglob("*")) if f.is_file()
             and f.name != "manifest.json"}
    import hashlib
    entries = {}
    for rel, f in files.items():
        with open(f, "rb") as fh:
            entries[rel] = {"bytes": f.stat().st_size,
                            "sha256": hashlib.file_digest(fh, "sha256").hexdigest()}
    step = int(ck.name.split("_")[-1])
    (ck / "manifest.json").write_text(json.dumps({"format": "codeforge-checkpoint/2", "step": step,
                                                  "files": entries}))


def edit_model(ck: Path, manifest: bool = True, **model) -> None:
    cfg = json.loads((ck / "config.json").read_text())
    cfg["model"].update(model)
    (ck / "config.json").write_text(json.dumps(cfg))
    if manifest:
        rehash(ck)
    else:
        (ck / "manifest.json").unlink()


def sparse_weights(path: Path, model_cfg: dict) -> None:
    """A safetensors file whose header holds every tensor of `model_cfg` at full size, the data a hole: a
    sparse file, a few KB on disk, that says the model is real (config and weights agree)."""
    from codeforge.models import model_config, state_shapes
    shapes, tied = state_shapes(model_config(model_cfg))
    # a tied tensor is stored once (safetensors keeps lm_head's name)
    skip = {n for g in tied for n in g[:-1]}
    header, at = {}, 0
    for name, shape in shapes.items():
        if name not in skip:
            header[name] = {"dtype": "F32", "shape": list(shape),
                            "data_offsets": [at, at + 4 * math.prod(shape)]}
            at += 4 * math.prod(shape)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + at)


# 4.8B parameters, 19 GB in float32
BIG = dict(n_layer=24, n_embd=4096, n_head=32, n_kv_head=32, ffn_hidden=16384)
MAXIMA = dict(n_layer=256, n_embd=16_384, n_head=256, n_kv_head=256, vocab_size=200_000, block_size=131_072,
              ffn_hidden=1 << 20)


def generate(run: Path) -> list[str]:
    return ["generate", "--run", str(run), "--prompt", "x", "--max-new-tokens", "2"]


def declared(command: str, model: dict) -> Callable[[Path, Base], list[str]]:
    """config.json declares `model`, the manifest hashed again; model.safetensors is the small real one."""
    def build(d: Path, base: Base) -> list[str]:
        run, ck = base.copy_run(d)
        edit_model(ck, **model)
        return {"generate": generate(run),
                "eval": ["eval", "--run", str(run), "--syntax-samples", "0"],
                "serve": ["serve", "--run", str(run), "--port", "0"],
                "export": ["export", "--run", str(run), "--format", "hf", "--out", str(d / "out"),
                           "--no-verify"],
                "train": ["train", "--data", str(base.data), "--out", str(d / "new"), "--init-from", str(run),
                          "--max-iters", "1", "--device", "cpu", "--no-progress",
                          "--no-tensorboard"]}[command]
    return build


def big_and_real(d: Path, base: Base) -> list[str]:
    run, ck = base.copy_run(d)
    edit_model(ck, manifest=False, **BIG)
    sparse_weights(ck / "model.safetensors", json.loads((ck / "config.json").read_text())["model"])
    return generate(run)


def fifo(rel: str, manifest: bool) -> Callable[[Path, Base], list[str]]:
    def build(d: Path, base: Base) -> list[str]:
        run, ck = base.copy_run(d)
        if not manifest:
            (ck / "manifest.json").unlink()
        target = run / "checkpoints" / rel if rel == "latest" else ck / rel
        target.unlink()
        os.mkfifo(target)
        return generate(run)
    return build


def weights_bytes(data: bytes) -> Callable[[Path, Base], list[str]]:
    def build(d: Path, base: Base) -> list[str]:
        run, ck = base.copy_run(d)
        (ck / "model.safetensors").write_bytes(data)
        rehash(ck)
        return generate(run)
    return build


def config_text(text: str) -> Callable[[Path, Base], list[str]]:
    def build(d: Path, base: Base) -> list[str]:
        run, ck = base.copy_run(d)
        (ck / "config.json").write_text(text)
        rehash(ck)
        return generate(run)
    return build


def model_value(**model) -> Callable[[Path, Base], list[str]]:
    def build(d: Path, base: Base) -> list[str]:
        run, ck = base.copy_run(d)
        edit_model(ck, **model)
        return generate(run)
    return build


def state_step(step) -> Callable[[Path, Base], list[str]]:
    def build(d: Path, base: Base) -> list[str]:
        run, ck = base.copy_run(d)
        state = json.loads((ck / "train_state.json").read_text())
        state["step"] = step
        (ck / "train_state.json").write_text(json.dumps(state))
        rehash(ck)
        return ["train", "--data", str(base.data), "--out", str(run), "--resume", "--max-iters", "4"]
    return build


def run_toml(text: str) -> Callable[[Path, Base], list[str]]:
    def build(d: Path, base: Base) -> list[str]:
        run, _ = base.copy_run(d)
        (run / "config.toml").write_text(text)
        return ["train", "--data", str(base.data), "--out", str(run), "--resume", "--max-iters", "4"]
    return build


def resume_declared(d: Path, base: Base) -> list[str]:
    """config.toml and the checkpoint's config.json both say 24 x 4096 (so they agree), manifest re-hashed."""
    run, ck = base.copy_run(d)
    edit_model(ck, **BIG)
    lines = (run / "config.toml").read_text().splitlines()
    (run / "config.toml").write_text("\n".join(f"{k} = {BIG[k]}" if (k := line.split(" = ")[0]) in BIG
                                               else line for line in lines) + "\n")
    return ["train", "--data", str(base.data), "--out", str(run), "--resume", "--max-iters", "4"]


def secret_file(d: Path) -> Path:
    s = d / "elsewhere" / "secret.json"
    s.parent.mkdir()
    s.write_text(json.dumps({"pad_token": SECRET}))
    return s


def secret_in(out_name: str) -> Callable[[Path], bool]:
    """After the run: does any file under d/out_name hold the secret?"""
    def leaked(d: Path) -> bool:
        out = d / out_name
        return out.exists() and any(f.is_file() and SECRET.encode() in f.read_bytes() for f in out.rglob("*"))
    return leaked


def linked_tokenizer_file(d: Path, base: Base) -> list[str]:
    run, ck = base.copy_run(d)
    f = ck / "tokenizer" / "tokenizer_config.json"
    f.unlink(missing_ok=True)
    f.symlink_to(secret_file(d))
    rehash(ck)
    return ["export", "--run", str(run), "--format", "hf", "--out", str(d / "out"), "--no-verify"]


def hf_config(**change) -> Callable[[Path, Base], list[str]]:
    def build(d: Path, base: Base) -> list[str]:
        hf = base.copy_hf(d)
        c = json.loads((hf / "config.json").read_text())
        c.update(change)
        (hf / "config.json").write_text(json.dumps(c))
        return ["import", "--hf", str(hf), "--out", str(d / "out"), "--no-verify"]
    return build


def hf_big_and_real(d: Path, base: Base) -> list[str]:
    """The Llama export with config.json at 24 x 4096 and a sparse model.safetensors holding exactly the
    tensors (Hugging Face names and shapes: the key map, fused q|k|v and gate|up split) of that model."""
    from codeforge.export.families import expand, splits
    from codeforge.export.hf import config_from_hf
    from codeforge.models import state_shapes
    hf = base.copy_hf(d)
    c = json.loads((hf / "config.json").read_text())
    c.update(hidden_size=4096, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
             head_dim=128, intermediate_size=16384)
    (hf / "config.json").write_text(json.dumps(c))
    m, fam = config_from_hf(c)
    ours, rows = state_shapes(m)[0], splits(m)
    header, at = {}, 0
    for name, theirs in expand(fam.keys, m.n_layer):
        if name not in ours or (name == "lm_head.weight" and m.tie_embeddings):
            continue
        if isinstance(theirs, tuple):  # a fused tensor of ours is several of theirs, split by rows
            kind = next(k for k in rows if f".{k}." in f".{name}")
            parts = [(t, (r, *ours[name][1:])) for t, r in zip(theirs, rows[kind])]
        else:
            parts = [(theirs, ours[name])]
        for t, shape in parts:
            n = 4 * math.prod(shape)
            header[t] = {"dtype": "F32", "shape": list(shape), "data_offsets": [at, at + n]}
            at += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(hf / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + at)
    return ["import", "--hf", str(hf), "--out", str(d / "out"), "--no-verify"]


def hf_linked(name: str) -> Callable[[Path, Base], list[str]]:
    def build(d: Path, base: Base) -> list[str]:
        hf = base.copy_hf(d)
        (hf / name).unlink()
        (hf / name).symlink_to(secret_file(d))
        return ["import", "--hf", str(hf), "--out", str(d / "out"), "--no-verify"]
    return build


def hf_fifo(name: str) -> Callable[[Path, Base], list[str]]:
    def build(d: Path, base: Base) -> list[str]:
        hf = base.copy_hf(d)
        (hf / name).unlink()
        os.mkfifo(hf / name)
        return ["import", "--hf", str(hf), "--out", str(d / "out"), "--no-verify"]
    return build


def hf_weights(data: bytes) -> Callable[[Path, Base], list[str]]:
    def build(d: Path, base: Base) -> list[str]:
        hf = base.copy_hf(d)
        (hf / "model.safetensors").write_bytes(data)
        return ["import", "--hf", str(hf), "--out", str(d / "out"), "--no-verify"]
    return build


RANDOM = random.Random(0).randbytes(4096)
LONG_HEADER = (10**6).to_bytes(8, "little") + b"{}"
NOT_JSON = (10).to_bytes(8, "little") + b"not json!!"


@dataclass
class Case:
    name: str  # what is hostile about the input
    # writes the input under an empty dir; returns the codeforge argv
    build: Callable[[Path, Base], list[str]]
    leaked: Callable[[Path], bool] | None = None  # after the run: did a file from outside reach the output?


CHECKPOINT_CASES = [
    Case("config.json 24x4096, manifest re-hashed", declared("generate", BIG)),
    Case("config.json 24x4096, manifest re-hashed", declared("eval", BIG)),
    Case("config.json 24x4096, manifest re-hashed", declared("serve", BIG)),
    Case("config.json 24x4096, manifest re-hashed", declared("export", BIG)),
    Case("config.json 24x4096, manifest re-hashed", declared("train", BIG)),
    Case("config.json at the range maxima", declared("generate", MAXIMA)),
    Case("24x4096 config + matching sparse weights", big_and_real),
    Case("tie_embeddings flipped (weights do not fit)", model_value(tie_embeddings=False)),
    Case("FIFO tokenizer.json, no manifest", fifo("tokenizer/tokenizer.json", manifest=False)),
    Case("FIFO manifest.json", fifo("manifest.json", manifest=True)),
    Case("FIFO checkpoints/latest", fifo("latest", manifest=True)),
    Case("model.safetensors: random bytes", weights_bytes(RANDOM)),
    Case("model.safetensors: header length > file", weights_bytes(LONG_HEADER)),
    Case("model.safetensors: header not JSON", weights_bytes(NOT_JSON)),
    Case("config.json is a list", config_text("[1, 2]")),
    Case("model.n_embd = \"x\"", model_value(n_embd="x")),
    Case("model.n_head = null", model_value(n_head=None)),
    Case("model.n_layer = -5", model_value(n_layer=-5)),
    Case("model.n_embd = 0", model_value(n_embd=0)),
    Case("train_state step = 1e18", state_step(1e18)),
    Case("train_state step = -5", state_step(-5)),
    Case("train_state step = \"x\"", state_step("x")),
    Case("config.toml model = \"x\"", run_toml('model = "x"\n')),
    Case("config.toml + config.json 24x4096 (resume)", resume_declared),
    Case("tokenizer file linked to a secret", linked_tokenizer_file, secret_in("out")),
    Case("HF num_hidden_layers = 10^6", hf_config(num_hidden_layers=10**6)),
    Case("HF hidden_size = \"x\"", hf_config(hidden_size="x")),
    Case("HF num_attention_heads = 0", hf_config(num_attention_heads=0)),
    Case("HF 24x4096 + matching sparse weights", hf_big_and_real),
    Case("HF special_tokens_map.json -> secret", hf_linked("special_tokens_map.json"), secret_in("out")),
    Case("HF FIFO tokenizer.json", hf_fifo("tokenizer.json")),
    Case("HF FIFO special_tokens_map.json", hf_fifo("special_tokens_map.json")),
    Case("HF model.safetensors: random bytes", hf_weights(RANDOM)),
    Case("HF model.safetensors: header not JSON", hf_weights(NOT_JSON)),
]

# -- corpus readers ------------------------------------------------------------------------------------------
# Kept apart: cases for `tokenizer train`, `prepare`, `make-sft`, ... on hostile corpus files go here.
# One line of 'a' with no newline compresses 32,000:1 in zstd, 1,000:1 in gzip;
# one parquet value compresses in
# its page; a dictionary page lets every row repeat one large value. Each file holds one good record besides,
# so a reader that skips the hostile one prepares a corpus of one document (exit 0).

GOOD_TEXT = b'{"text": "ok = 1\\n"}\n'
GOOD_CHAT = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
GOOD_PAIR = b'{"prompt": "add", "chosen": "a + b", "rejected": "a - b"}\n'


def one_line(path: Path, prefix: bytes, gib: float, good: bytes) -> Path:
    """`prefix`, gib GiB of 'a' without a newline, then a newline and one good record, compressed by the
    file's extension (.zst: 6 GiB in 190 KB; .gz: 1 GiB in 1 MB)."""
    if path.suffix == ".zst":
        import zstandard
        f = zstandard.ZstdCompressor(level=3).stream_writer(open(path, "wb"))
    else:
        import gzip
        f = gzip.open(path, "wb", compresslevel=9)
    with f:
        f.write(prefix)
        chunk = b"a" * (1 << 20)
        for _ in range(int(gib * 1024)):
            f.write(chunk)
        f.write(b'"}\n' + good)
    return path


def prepare_args(path: Path, d: Path, base: Base, *extra: str) -> list[str]:
    return ["prepare", "--input", str(path), "--tokenizer", str(base.tokenizer), "--out", str(d / "out"),
            "--val-fraction", "0", *extra]


def long_line(ext: str, gib: float, what: str) -> Callable[[Path, Base], list[str]]:
    def build(d: Path, base: Base) -> list[str]:
        if what == "text":
            return prepare_args(one_line(d / f"d.jsonl{ext}", b'{"text": "', gib, GOOD_TEXT), d, base)
        if what == "chat":
            path = one_line(d / f"c.jsonl{ext}", b'{"messages": [{"role": "user", "content": "', gib,
                            GOOD_CHAT)
            return prepare_args(path, d, base, "--chat")
        path = one_line(d / f"p.jsonl{ext}", b'{"prompt": "x", "chosen": "', gib, GOOD_PAIR)
        return ["train", "--stage", "dpo", "--init-from", str(base.run), "--data", str(path), "--out",
                str(d / "run"), "--max-iters", "1", "--device", "cpu", "--no-progress", "--no-tensorboard"]
    return build


HUGE_PARQUET = r"""
import sys
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
n = 300 << 20
huge = pa.StringArray.from_buffers(1, pa.py_buffer(np.array([0, n], dtype=np.int32).tobytes()),
                                   pa.py_buffer(b"a" * n))
with pq.ParquetWriter(sys.argv[1], pa.schema([("text", pa.string())]), compression="zstd") as w:
    w.write_table(pa.table({"text": ["ok = 1\n"]}))
    w.write_table(pa.table({"text": huge}))
    w.write_table(pa.table({"text": ["ok = 2\n"]}))
"""


def parquet_huge_value(d: Path, base: Base) -> list[str]:
    """One 300 MB value of 'a' in its own row group between two good ones: a 10 KB file. Written by a child:
    the 1.5 GB this takes would stay in this process, and a case's child inherits its peak RSS at the fork."""
    subprocess.run([sys.executable, "-c", HUGE_PARQUET, str(d / "big.parquet")], check=True)
    return prepare_args(d / "big.parquet", d, base)


def parquet_dictionary(d: Path, base: Base) -> list[str]:
    """10,000 rows pointing at one 900 KB dictionary entry, one good row: a 1,024-row batch is 900 MB decoded,
    twice (Arrow's dense copy, then Python's)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    col = pa.DictionaryArray.from_arrays(pa.array([1] + [0] * 10_000, pa.int32()),
                                         pa.array(["b" * 900_000, "ok = 1\n"]))
    pq.write_table(pa.table({"text": col}), d / "dict.parquet", compression="zstd")
    return prepare_args(d / "dict.parquet", d, base)


def many_documents(d: Path, base: Base) -> list[str]:
    """200 distinct 100 KB documents in a 100 KB .jsonl.zst (zstd finds each in the one before): 20 MB of text
    that `prepare` encoded as one batch, the tokenizer holding 150-320 bytes per
    byte of text while it encodes."""
    import zstandard
    body = (STDLIB / "typing.py").read_text()[:100_000]
    lines = "".join(json.dumps({"text": f"# document {i}\n" + body}) + "\n" for i in range(200))
    (d / "many.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=19).compress(lines.encode()))
    return prepare_args(d / "many.jsonl.zst", d, base)


def tree_with(d: Path) -> Path:
    root = d / "tree"
    root.mkdir()
    (root / "good.py").write_text("def good():\n    return 1\n")
    return root


def odd_file_name(d: Path, base: Base) -> list[str]:
    """A file whose name is not UTF-8 (latin-1 bytes), as a tarball from another system holds."""
    root = tree_with(d)
    with open(os.path.join(os.fsencode(root), b"caf\xe9.py"), "wb") as f:
        f.write(b"def cafe():\n    return 2\n")
    return prepare_args(root, d, base)


def linked_secret(d: Path, base: Base) -> list[str]:
    """A symlink in the tree, named like code, to a credentials file outside it."""
    root = tree_with(d)
    secret = d / "home" / ".aws" / "credentials.py"
    secret.parent.mkdir(parents=True)
    secret.write_text(f"{SECRET!r}\n")
    (root / "settings.py").symlink_to(secret)
    return prepare_args(root, d, base)


def fifo_in_tree(d: Path, base: Base) -> list[str]:
    root = tree_with(d)
    os.mkfifo(root / "pipe.py")
    return prepare_args(root, d, base)


def secret_in_shards(out_name: str) -> Callable[[Path], bool]:
    """After the run: does a document of the prepared data under d/out_name hold the secret? (Shards hold
    token ids, so they are decoded with the tokenizer copied beside them.)"""
    def leaked(d: Path) -> bool:
        out = d / out_name
        if not (out / "meta.json").exists():
            return False
        from codeforge.data.shards import ShardSet
        from codeforge.tokenizer import CodeTokenizer
        tok = CodeTokenizer.load(out / "tokenizer")
        for split in ("train", "val"):
            ss = ShardSet(out, split)
            if any(SECRET in tok.decode(ss.document(i).tolist()) for i in range(ss.documents)):
                return True
        return False
    return leaked


CORPUS_CASES: list[Case] = [
    Case("JSONL .zst: one 6 GiB line (190 KB file)", long_line(".zst", 6, "text")),
    Case("JSONL .gz: one 1 GiB line (1 MB file)", long_line(".gz", 1, "text")),
    Case("chat JSONL .zst: one 6 GiB line", long_line(".zst", 6, "chat")),
    Case("pairs JSONL .zst: one 6 GiB line", long_line(".zst", 6, "pairs")),
    Case("parquet: one 300 MB value (10 KB file)", parquet_huge_value),
    Case("parquet: 10,000 rows x one 900 KB dict value", parquet_dictionary),
    Case("JSONL .zst: 200 distinct 100 KB documents", many_documents),
    Case("file name with a non-UTF-8 byte", odd_file_name),
    Case("tree symlink to a secret outside it", linked_secret, secret_in_shards("out")),
    Case("FIFO inside the tree", fifo_in_tree),
]

CASES = CHECKPOINT_CASES + CORPUS_CASES


# -- running one case ----------------------------------------------------------------------------------------

@dataclass
class Result:
    command: str
    rss_mb: float
    seconds: float
    outcome: str
    line: str  # the last line of stderr


CAP_WORDS = ("MemoryError", "can't allocate memory", "Cannot allocate memory", "std::bad_alloc",
             "out of memory")


def run_case(case: Case, base: Base, code: Path, limit: float, cap: int, work: Path) -> Result:
    d = Path(tempfile.mkdtemp(dir=work))
    argv = case.build(d, base)
    env = {**os.environ, "PYTHONPATH": str(code), "CODEFORGE_CPU_BF16": "0"}

    def capped() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    out, err = d / ".stdout", d / ".stderr"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        # cwd: the case's own directory, never a checkout (`-m` puts the working directory first on sys.path)
        p = subprocess.Popen([sys.executable, "-m", "codeforge", *argv], stdout=fo, stderr=fe, cwd=d,
                             stdin=subprocess.DEVNULL, env=env, preexec_fn=capped, start_new_session=True)
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        timer = threading.Timer(limit, kill)
        t0 = time.monotonic()
        timer.start()
        _, status, usage = os.wait4(p.pid, 0)  # this child's own rusage: its peak RSS
        seconds = time.monotonic() - t0
        timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
    try:  # a child it started (serve's workers) may outlive it
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    stderr = err.read_bytes().decode(errors="replace")
    lines = stderr.strip().splitlines()
    line = lines[-1] if lines else ""
    rc = p.returncode
    if timed_out.is_set():
        outcome = f"hang (killed at {limit:.0f} s)"
    elif any(w in stderr for w in CAP_WORDS) or rc in (-signal.SIGKILL, -signal.SIGABRT, -signal.SIGSEGV):
        outcome = f"hit the {cap / 2**30:.0f} GiB cap"
    elif "Traceback" in stderr:
        outcome = f"traceback ({line.split(':')[0][:40]})"
    elif rc == 2 and line.startswith("error: "):
        outcome = "clear error"
    elif rc == 0:
        outcome = "accepted (exit 0)" + (", secret copied" if case.leaked and case.leaked(d) else "")
    else:
        outcome = f"exit {rc}"
    shutil.rmtree(d, ignore_errors=True)
    return Result(command(argv), usage.ru_maxrss / 1024, seconds, outcome, line)


def command(argv: list[str]) -> str:
    return " ".join(argv[:2] if argv[0] in ("tokenizer", "data", "config") else argv[:1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code-dir", type=Path, default=HERE,
                    help="checkout whose codeforge runs the cases (default: "
                                                               "this one)")
    ap.add_argument("--before", type=Path, default=None,
                    help="also run a checkout of the code before the fix, and "
                                                              "print both (before | after: --code-dir)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a case may run (default 60)")
    ap.add_argument("--cap-gb", type=float, default=3.0, help="address-space cap of a case, GiB (default 3)")
    ap.add_argument("--cases", default="", help="only cases whose name contains this")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--errors", action="store_true",
                    help="print each case's last stderr line after the table")
    a = ap.parse_args()
    cap = int(a.cap_gb * 2**30)
    sys.path.insert(0, str(HERE))  # the builders import this checkout's codeforge
    with tempfile.TemporaryDirectory(prefix="hostile-") as w:
        work = Path(w)
        base = Base(work / "base")
        codes = [("before", a.before)] if a.before else []
        codes.append(("after" if a.before else "result", a.code_dir))
        labels = [label for label, _ in codes]
        print(header(labels), flush=True)
        rows = []
        for case in CASES:
            if a.cases and a.cases not in case.name:
                continue
            row: dict = {"case": case.name}
            for label, code in codes:
                r = run_case(case, base, code.resolve(), a.timeout, cap, work)
                row["command"], row[label] = r.command, r.__dict__
            rows.append(row)
            print(fmt_row(row, labels), flush=True)
        if a.errors:
            print()
            for row in rows:
                for label, _ in codes:
                    print(f"{row['case']} | {row['command']} | {label}: {row[label]['line'][:300]}")
        if a.json:
            a.json.write_text(json.dumps({"codes": {k: str(v) for k, v in codes}, "timeout": a.timeout,
                                          "cap_gb": a.cap_gb, "rows": rows}, indent=1))


def header(labels: list[str]) -> str:
    cols = "".join(f" | {label + ': peak RSS, s, outcome':<52}" for label in labels)
    return f"{'case':<44} | {'command':<8}{cols}\n" + "-" * (56 + 55 * len(labels))


def fmt_row(row: dict, labels: list[str]) -> str:
    cells = "".join(f" | {row[k]['rss_mb']:6.0f} MB {row[k]['seconds']:5.1f} s  {row[k]['outcome']:<30}"
                    for k in labels)
    return f"{row['case']:<44} | {row['command']:<8}{cells}"


if __name__ == "__main__":
    main()
