"""What a file from outside may cost before anything is built from it: checkpoints (and the Hugging Face
directories `codeforge import --hf` reads) can come from anyone, and a manifest proves only that the files are
the ones it lists (anyone can edit config.json and hash the files again). So, before a model is built:

- every file read is a regular file (a FIFO would block the read forever, a device would never end), read
  through one descriptor opened without blocking and checked with fstat, and no larger than its kind can be;
- a file that is a symbolic link stays inside its directory: a link elsewhere would carry that file (a key, a
  token) into the run, and into every checkpoint and export after it;
- the model config is checked field by field against its declaration in models/ (type, range, choices; the
  divisibility the layers need), so a string, a null, a zero or 10^18 is one line naming the field;
- the declared model is compared with the weights' safetensors header (8-byte length + JSON, read alone, with
  a size cap; data offsets inside the file), so a config that declares more than the weights hold is refused
  without building it;
- the memory the model takes (float32 parameters plus the weights read from disk) is compared with the memory
  there is: MemAvailable, the cgroup's limit, the address-space limit (RLIMIT_AS), whichever is least.

Every refusal is one line that names the file, the field and what to do (the caller's `fix`)."""

from __future__ import annotations

import json
import math
import os
import resource
import stat
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

import torch

from .. import CodeforgeError
from ..corpus import walk_tree
from ..models import ARCHS, config_class, state_shapes

Error = type[CodeforgeError]  # the error class a caller raises (CheckpointError, ExportError, ...)

# Caps on what is read whole. codeforge's own files are KBs; the caps leave room for real models (a
# safetensors header lists ~100 bytes per tensor: a few thousand tensors are a few hundred KB) and keep
# what an adversarial file costs to parse low (Python's json takes ~25x the text for `[{},{},...]`).
# config.json (codeforge's lists ~70 bytes per training-data file; Hugging Face's: KBs)
CONFIG_BYTES = 4 << 20
STATE_BYTES = 8 << 20  # train_state.json (counters, RNG states, the loader cursor)
MANIFEST_BYTES = 8 << 20  # manifest.json (one entry per file; a sharded checkpoint has one file per rank)
POINTER_BYTES = 4096  # latest, best, final
HEADER_BYTES = 8 << 20  # a safetensors header

# safetensors dtypes and their sizes in bytes
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}

KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def not_regular(mode: int) -> str | None:
    """What a file of st_mode `mode` is when it is not a regular file, else None."""
    return None if stat.S_ISREG(mode) else KINDS.get(stat.S_IFMT(mode), "a special file")


def check_regular(path: Path, error: Error, fix: str) -> int:
    """The size of `path`, a regular file (links followed), for a reader that opens it by name (safetensors,
    tokenizers); `error` naming what it is otherwise."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path} is missing; {fix}") from None
    except OSError as e:
        raise error(f"{path} cannot be read ({e.strerror}); {fix}") from e
    kind = not_regular(st.st_mode)
    if kind:
        raise error(f"{path} is {kind}, not a regular file; {fix}")
    return st.st_size


def open_regular(path: Path, error: Error, fix: str) -> tuple[int, os.stat_result]:
    """(a descriptor open for reading, its fstat) of `path`, refused unless it is a regular file. Opened
    without blocking (O_NONBLOCK: a FIFO opens at once instead of waiting for a writer) and checked on the
    open descriptor, so what is read is what was checked. The caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{path} is missing; {fix}") from None
    except OSError as e:
        raise error(f"{path} cannot be read ({e.strerror}); {fix}") from e
    st = os.fstat(fd)
    kind = not_regular(st.st_mode)
    if kind:
        os.close(fd)
        raise error(f"{path} is {kind}, not a regular file; {fix}")
    return fd, st


def read_regular(path: Path, limit: int, error: Error, fix: str) -> bytes:
    """The bytes of `path`, refused unless it is a regular file (open_regular) of at most `limit` bytes."""
    fd, st = open_regular(path, error, fix)
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise error(f"{path} is {st.st_size:,} bytes, more than the {limit:,} such a file may have; "
                        f"{fix}")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise error(f"{path} cannot be read ({e.strerror}); {fix}") from e
    if len(data) > limit:  # grew while read
        raise error(f"{path} is more than the {limit:,} bytes such a file may have; {fix}")
    return data


def read_json(path: Path, limit: int, error: Error, fix: str) -> Any:
    data = read_regular(path, limit, error, fix)  # outside the try: a CodeforgeError is a ValueError too
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise error(f"{path} is not JSON ({type(e).__name__}: {str(e)[:200]}); {fix}") from None


def check_inside(path: Path, root: Path, error: Error, fix: str = "") -> None:
    """Refuse `path` when it is a link (or under one) that resolves outside directory `root`."""
    real_root = Path(root).resolve()
    target = Path(path).resolve()
    if target != real_root and real_root not in target.parents:
        fix = fix or (f"copy the file into {root} if it belongs there (a link out of the directory would "
                      f"carry whatever it names into the run, its checkpoints and exports)")
        raise error(f"{path} is a link to {target}, outside {root}; {fix}")


def check_files(root: Path, error: Error, fix: str) -> None:
    """Every file under directory `root` is a regular file inside it (links that stay inside are followed)."""
    for dirpath, dirnames, filenames in walk_tree(str(root)):  # any depth, links not entered
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                check_inside(p, root, error)
            if name in filenames:
                check_regular(p, error, fix)


# -- safetensors headers -------------------------------------------------------------------------------------

def safetensors_header(path: Path, error: Error, fix: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from the header of safetensors file `path`, reading the header alone (an
    8-byte little-endian length, then that much JSON), checked the way safetensors checks it: the length
    within the file and HEADER_BYTES, a JSON object of entries {dtype, shape, data_offsets}, each tensor's
    bytes inside the file and of the size its shape and dtype say."""
    fd, st = open_regular(path, error, fix)
    with os.fdopen(fd, "rb") as f:
        size = st.st_size
        if size < 8:
            raise error(f"{path} is {size} bytes, shorter than the 8-byte header length a safetensors file "
                        f"starts with; {fix}")
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:
            raise error(f"{path}: header length {n:,} is larger than the file ({size:,} bytes): not a "
                        f"safetensors file, or a truncated one; {fix}")
        if n > HEADER_BYTES:
            raise error(f"{path}: header length {n:,} is more than the {HEADER_BYTES:,} bytes codeforge "
                        f"reads; {fix}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise error(f"{path}: the header is not JSON ({type(e).__name__}: {str(e)[:120]}); {fix}") from None
    if not isinstance(header, dict):
        raise error(f"{path}: the header is not a JSON object but a {type(header).__name__}; {fix}")
    data = size - 8 - n
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: the header's entry {name}"
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise error(f"{where} is not {{dtype, shape, data_offsets}}; {fix}")
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in DTYPE_BYTES:
            raise error(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}; {fix}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise error(f"{where}: shape {shape!r} is not a list of sizes; {fix}")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs)
                or not 0 <= offs[0] <= offs[1] <= data):
            raise error(f"{where}: data_offsets {offs!r} do not lie within the file's {data:,} bytes "
                        f"of data; {fix}")
        if offs[1] - offs[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise error(f"{where}: data_offsets {offs!r} hold {offs[1] - offs[0]:,} bytes, but shape {shape} "
                        f"of {dtype} needs {math.prod(shape) * DTYPE_BYTES[dtype]:,}; {fix}")
        out[name] = (dtype, tuple(shape))
    return out


def header_bytes(header: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) * DTYPE_BYTES[dtype] for dtype, shape in header.values())


# -- model configs -------------------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def field_problem(f: Field, v: Any) -> str | None:
    """What is wrong with value `v` (as read from a file) for config field `f`, by the field's declaration:
    its type (that of its default), choices and range (fields.py); None if nothing."""
    kind = type(f.default) if f.default is not MISSING else None
    if kind is bool and not isinstance(v, bool):
        return "is not true or false"
    if kind is int and not _is_int(v):
        return "is not an integer"
    if kind is float and (not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v)):
        return "is not a number"
    if kind is str and not isinstance(v, str):
        return "is not a string"
    m = f.metadata
    if m.get("choices") and v not in m["choices"]:
        return f"is not one of {m['choices']}"
    if m.get("range") and not (m.get("zero_means") and v == 0):
        lo, hi = m["range"]
        if not ((lo < v if m.get("open_low") else lo <= v) and v <= hi):
            return f"is out of range {'(' if m.get('open_low') else '['}{lo}, {hi}]"
    return None


def model_config_from(d: Any, where: str | Path, error: Error, fix: str, names: dict[str, str] | None = None):
    """The model config object for saved dict `d` (the `model` section of a config.json), every field checked
    against its declaration and the layers' divisibility before any of it is used. `where` names the file;
    names: {field: the file's own key}, for files that spell the fields their own way (Hugging Face)."""
    names = names or {}

    def say(key: str, v: Any, problem: str) -> CodeforgeError:
        own = f"{names[key]} = {v!r} (codeforge's model.{key})" if key in names else f"model.{key} = {v!r}"
        return error(f"{where}: {own} {problem}; {fix}")

    if not isinstance(d, dict):
        raise error(f"{where}: model is a {type(d).__name__}, not an object of model settings; {fix}")
    arch = d.get("arch", "gpt")
    if not isinstance(arch, str) or arch not in ARCHS:
        raise say("arch", arch, f"is not one of {tuple(ARCHS)}")
    cls = config_class(arch)
    declared = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(declared))
    if unknown:
        raise error(f"{where}: model has settings a model.arch = {arch!r} does not have: {unknown}; {fix}")
    for key, v in d.items():
        problem = field_problem(declared[key], v)
        if problem:
            raise say(key, v, problem)
    try:
        cfg = cls.from_dict(dict(d))
    except (TypeError, ValueError) as e:
        raise error(f"{where}: model: {e}; {fix}") from None
    if cfg.n_embd % cfg.n_head:
        raise say("n_embd", cfg.n_embd, f"is not divisible by model.n_head = {cfg.n_head}")
    if cfg.n_head % cfg.n_kv_head:
        raise say("n_head", cfg.n_head, f"is not divisible by model.n_kv_head = {cfg.n_kv_head}")
    if cfg.pos == "rope" and cfg.head_dim % 2:
        raise say("n_embd", cfg.n_embd,
                  f"over model.n_head = {cfg.n_head} gives an odd head size {cfg.head_dim}, "
                  "and rotary positions need an even one")
    return cfg


def dims(cfg) -> str:
    """The fields that size a model, as `model.n_layer=2, model.n_embd=64, ...` for messages."""
    keys = ("n_layer", "planner_layers", "generator_layers", "refiner_layers", "n_embd", "n_head",
            "n_kv_head", "ffn_hidden", "vocab_size", "block_size", "plan_len", "code_len")
    have = {f.name for f in fields(cfg)}
    return ", ".join(f"model.{k}={getattr(cfg, k)}" for k in keys if k in have)


def model_shapes(model: torch.nn.Module) -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
    """({state-dict name: shape}, groups of names that are one tensor (tied weights, stored once))."""
    sd = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, t in sd.items():
        groups.setdefault(id(t), []).append(name)
    return {k: tuple(v.shape) for k, v in sd.items()}, list(groups.values())


def declared_shapes(cfg) -> tuple[dict[str, tuple[int, ...]], list[list[str]], int]:
    """model_shapes() of the model `cfg` declares, from the config alone (models.state_shapes: nothing is
    built, not even on the meta device, where PyTorch's first computation loads its compiler: seconds), and
    its parameter count (tied tensors once)."""
    shapes, tied = state_shapes(cfg)
    in_group = {n for g in tied for n in g}
    groups = [list(g) for g in tied] + [[n] for n in shapes if n not in in_group]
    return shapes, groups, sum(math.prod(shapes[g[0]]) for g in groups)


def weights_problem(header: dict[str, tuple[str, tuple[int, ...]]], shapes: dict[str, tuple[int, ...]],
                    groups: list[list[str]], new_ok: tuple[str, ...] = ()) -> str | None:
    """How the tensors of a weights file (`header`) differ from a model's (`shapes`, `groups`: tied names, of
    which the file holds one), as "missing [...], unexpected [...], other shape {...}"; None if they agree.
    new_ok: prefixes of the model's parameters the file may lack."""
    missing = sorted(g[0] for g in groups if not any(n in header for n in g)
                     and not (new_ok and g[0].startswith(new_ok)))
    unexpected = sorted(set(header) - set(shapes))
    other = {n: (list(header[n][1]), list(shapes[n])) for n in sorted(set(header) & set(shapes))
             if tuple(header[n][1]) != tuple(shapes[n])}
    if not (missing or unexpected or other):
        return None
    said = f"missing {missing[:5]}, unexpected {unexpected[:5]}"
    if other:
        first = dict(list(other.items())[:3])
        said += f", other shape (file, model) {first}" + (f" and {len(other) - 3} more" if len(other) > 3
                                                          else "")
    return said


# -- memory --------------------------------------------------------------------------------------------------

def _kib_field(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), when it has a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line.split("::", 1)[1].strip() for line in f if line.startswith("0::")), None)
        if rel is None:
            return None
        d = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (d / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((d / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def available_memory() -> tuple[int, str] | None:
    """(bytes this process can still take, what says so): the least of MemAvailable (/proc/meminfo; psutil
    elsewhere), the cgroup's memory.max and the address-space limit (RLIMIT_AS less what is mapped); None
    when none of them can be read."""
    found: list[tuple[int, str]] = []
    avail = _kib_field("/proc/meminfo", "MemAvailable")
    if avail is None:
        try:
            import psutil
            avail = int(psutil.virtual_memory().available)
        except ImportError:
            pass
    if avail is not None:
        found.append((avail, "MemAvailable"))
    room = _cgroup_room()
    if room is not None:
        found.append((room, "the cgroup's memory.max"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        mapped = _kib_field("/proc/self/status", "VmSize") or 0
        found.append((soft - mapped,
                      f"RLIMIT_AS {soft / 2**30:.1f} GiB, {mapped / 2**30:.1f} GiB of it mapped"))
    return min(found) if found else None


def check_memory(need: int, what: str, error: Error,
                 fix: str = "run it on a machine with more memory, or use a smaller model") -> None:
    """Refuse when `need` bytes are more than available_memory(); `what` says what needs them."""
    have = available_memory()
    if have is not None and need > have[0]:
        raise error(f"{what} needs about {need / 2**30:.1f} GiB of memory and {max(have[0], 0) / 2**30:.1f} "
                    f"GiB is available ({have[1]}); {fix}")
