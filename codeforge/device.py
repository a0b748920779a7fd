"""The one place that chooses device and precision (and says why), plus peak FLOPs for MFU."""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

import torch

from . import CodeforgeError
from .fields import ConfigError


class DeviceError(CodeforgeError):
    """The requested device or precision is not available here."""


# Dense bf16/fp16 tensor-core peak, TFLOP/s, from vendor datasheets (no sparsity).
PEAK_TFLOPS = {
    "H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H200": 989.0,
    "GH200": 989.0, "A100": 312.0, "A10G": 125.0, "A10": 125.0, "L40S": 362.0, "L4": 121.0, "V100": 125.0,
    "T4": 65.0, "RTX 4090": 165.0, "RTX 4080": 97.5, "RTX 4070": 58.0, "RTX 3090": 71.0, "RTX 3080": 59.5,
    "RTX 3060": 25.5, "GTX 1660": 10.0, "MI300X": 1307.0, "MI250X": 383.0, "MI210": 181.0,
    "RX 7900 XTX": 123.0, "RX 6700 XT": 25.0,
}


# "system": leave the C library's memory policy as it is (see keep_freed_memory)
MALLOC_ENV = "CODEFORGE_MALLOC"
_MALLOC: str | None = None  # what keep_freed_memory() did, said with the device line
# the policy when $CODEFORGE_MALLOC is unset, and why (system_memory)
_MALLOC_DEFAULT: tuple[str, str] = ("keep", "")
THREADS_ENV = "CODEFORGE_THREADS"  # intra-op threads, overriding the policy below (0 or unset: the policy)
# the threads thread_policy() chose and why, said with the device line
_THREADS: tuple[int, str] | None = None


def cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs a cgroup quota lets this process use (a container's `--cpus`, a systemd CPUQuota), the
    tightest along its cgroup's path (v2: cpu.max; v1: cpu.cfs_quota_us / cpu.cfs_period_us); None without
    one. The affinity mask alone would count every core of the host."""
    quotas = []
    base = Path(root)
    try:
        rel = next((x.split(":", 2)[2].strip() for x in Path(proc_cgroup).read_text().splitlines()
                    if x.startswith("0::")), None)
    except OSError:
        rel = None
    if rel is not None:  # v2: the process's cgroup and every parent up to the root
        p = base / rel.lstrip("/")
        while True:
            with contextlib.suppress(OSError, ValueError):
                q, period = (p / "cpu.max").read_text().split()[:2]
                if q != "max":
                    quotas.append(int(q) / int(period))
            if p == base or base not in p.parents:
                break
            p = p.parent
    for d in ("cpu", "cpu,cpuacct"):  # v1, as a container sees its own
        with contextlib.suppress(OSError, ValueError):
            q = int((base / d / "cpu.cfs_quota_us").read_text())
            if q > 0:
                quotas.append(q / int((base / d / "cpu.cfs_period_us").read_text()))
    return min(quotas) if quotas else None


def usable_cores() -> int:
    """The cores this process may run on (its affinity), at most what a cgroup quota allows (rounded up)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _own_runnable() -> int:
    """This process's threads that are running or waiting to run (state R in /proc/self/task/*/stat); at
    least 1, the thread asking."""
    n = 0
    try:
        for task in os.scandir("/proc/self/task"):
            try:
                with open(f"{task.path}/stat") as f:
                    n += f.read().rsplit(")", 1)[1].split()[0] == "R"
            except (OSError, IndexError):
                continue
    except OSError:
        pass
    return max(1, n)


def runnable_elsewhere(samples: int = 5, interval: float = 0.02) -> int:
    """How many threads other than this process's are running or waiting to run right now: the kernel's
    count of runnable tasks (/proc/loadavg's 4th field, an instant reading, unlike the load average) less
    this process's own runnable threads (a server starting up has several), the median of a few readings.
    0 where /proc cannot tell."""
    import statistics
    import time
    reads = []
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                total = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0
        reads.append(max(0, total - _own_runnable()))
        if i + 1 < samples:
            time.sleep(interval)
    return int(statistics.median(reads))


def thread_policy(requested: int | None = None) -> tuple[int, str]:
    """(threads, why) for PyTorch's intra-op pool, applied with torch.set_num_threads. In order: a flag or
    $CODEFORGE_THREADS; $OMP_NUM_THREADS set by the user (or torchrun, 1 a rank); else the cores this process
    may use (its affinity and any cgroup quota, shared by the ranks on this machine under torchrun) less those
    other work keeps busy at start-up, at least one. Threads that wait for each other on a core that another
    process holds make every operation as slow as the most delayed thread: on shared cores fewer threads
    finish sooner (docs/LOG.md#2026-11-25-under-load-idle-cores). Waiting threads sleep rather than spin:
    OMP_WAIT_POLICY=PASSIVE, set by codeforge/__init__.py before torch loads its OpenMP runtime (an explicit
    setting is kept)."""
    cores = usable_cores()
    env = os.environ.get(THREADS_ENV, "").strip()
    if requested:
        n, why = requested, "--threads"
    elif env and env != "0":
        try:
            n, why = int(env), f"${THREADS_ENV}"
        except ValueError:
            raise DeviceError(
                f"${THREADS_ENV}={env!r} is not a number of threads; unset it or give e.g. 2") from None
    elif os.environ.get("OMP_NUM_THREADS", "").strip():
        n, why = torch.get_num_threads(), "$OMP_NUM_THREADS"
    else:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        share = max(1, cores // ranks)
        busy = runnable_elsewhere()
        n = max(1, min(share, cores - busy))
        why = f"{cores} cores" + (f" / {ranks} ranks" if ranks > 1 else "") + (
            f", {busy} other runnable threads at start" if busy else ", none busy at start")
    if n < 1:
        raise DeviceError(f"{why}: {n} threads; give 1 or more")
    return n, why


def apply_thread_policy(requested: int | None = None) -> str:
    """Set the intra-op threads by thread_policy (and the memory policy, keep_freed_memory) and return the
    words for the device line (once per process; a later call with a request of its own applies that)."""
    global _THREADS
    if _THREADS is None or requested:
        n, why = thread_policy(requested)
        torch.set_num_threads(n)
        _THREADS = (n, why)
    return _policy_words(*_THREADS)


def _policy_words(n: int, why: str) -> str:
    """The device line's words for n intra-op threads chosen for `why`, the wait policy and the memory
    policy."""
    wait = os.environ.get("OMP_WAIT_POLICY", "unset")
    return f"{n} thread{'s' if n != 1 else ''} ({why}; OpenMP waits {wait.lower()}; {keep_freed_memory()})"


KEPT = "freed memory kept for reuse"  # the device line's words for keep_freed_memory's policy in force
# glibc's mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


def keep_freed_memory() -> str:
    """Make the C library keep freed memory for the next allocation instead of handing it back to the kernel,
    and say what was done (for the device line). Once per process; idempotent.

    Why: glibc serves every block over its mmap threshold (128 KiB, at most 32 MiB) with a fresh mmap and
    unmaps it on free, and returns the top of its heap past 128 KiB. A training step allocates and frees the
    same large tensors (activations, logits, gradients) every step, so each step the kernel maps and zeroes
    them again: 45,000 page faults and 80 ms of system time in a 300 ms step at 4 layers x 256, batch 4 x
    256, vocabulary 10k (docs/LOG.md#2026-11-27-memory-policy). With mmap off (M_MMAP_MAX 0) and the trim
    threshold at 2 GiB, freed blocks stay in the heap and are reused: under 1,000 faults a step, the step
    15-20% faster. The cost: the process keeps its peak heap until it exits instead of shrinking after a peak.

    Only on glibc (Linux); elsewhere, or with $CODEFORGE_MALLOC=system, or where the user set glibc's own
    malloc knobs ($MALLOC_MMAP_MAX_ and the like, glibc.malloc.* in $GLIBC_TUNABLES), nothing is changed;
    nor inside system_memory() (the server)."""
    global _MALLOC
    if _MALLOC is not None:
        return _MALLOC
    choice = os.environ.get(MALLOC_ENV, "").strip().lower()
    if choice not in ("", "keep", "system"):
        raise DeviceError(f"${MALLOC_ENV}={choice!r}: use keep (the default: freed memory kept for reuse) or "
                          "system (the C library's own policy)")
    if choice == "system":
        _MALLOC = f"memory policy: the C library's (${MALLOC_ENV}=system)"
    elif any(
        os.environ.get(k) for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
    ) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        _MALLOC = "memory policy: the C library's, as its environment variables set it"
    elif not choice and _MALLOC_DEFAULT[0] == "system":
        _MALLOC = (
            f"memory policy: the C library's ({_MALLOC_DEFAULT[1]}; ${MALLOC_ENV}=keep keeps freed memory)")
    else:
        import ctypes
        try:
            libc = ctypes.CDLL(None)  # the symbols already loaded: the C library this process runs on
            ok = bool(libc.gnu_get_libc_version) and libc.mallopt(_M_MMAP_MAX, 0) == 1 \
                and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
        except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl, Windows): left as it is
            ok = False
        _MALLOC = KEPT if ok else "memory policy: the C library's (not glibc)"
    return _MALLOC


@contextlib.contextmanager
def system_memory(why: str):
    """For the block, the C library's own memory policy instead of keep_freed_memory's, for `why` (said on the
    device line); $CODEFORGE_MALLOC=keep still keeps. After the block the policy before it is back (a server
    run inside another process, as the tests do, leaves that process as it found it). Enter it before
    choose_device.

    For a long-running server: its steps allocate few large blocks (one token a row), so keeping freed memory
    buys it nothing measurable (116 tokens/s and 1,123 MB at peak kept, against 123 and 1,104 with glibc's
    policy: a 128M model under 16 streaming clients, docs/LOG.md#2026-11-27-serve-memory-policy), while a
    process that never hands memory back can hold several times what it uses when its threads' heaps fragment.

    Where keep_freed_memory already acted in this process, glibc's settings are set to what its own
    defaults reach once its adaptive threshold has grown: blocks over 32 MiB mapped (and unmapped when freed),
    the heap's top trimmed past 64 MiB. glibc cannot be given its adaptive threshold back once mallopt set
    one."""
    global _MALLOC, _MALLOC_DEFAULT
    before, was_kept = _MALLOC_DEFAULT, _MALLOC == KEPT
    _MALLOC_DEFAULT = ("system", why)
    if was_kept and os.environ.get(MALLOC_ENV, "").strip().lower() != "keep":
        import ctypes
        libc = ctypes.CDLL(None)  # glibc: keep_freed_memory's mallopt succeeded in this process
        libc.mallopt(_M_MMAP_MAX, 65536)  # glibc's DEFAULT_MMAP_MAX
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
        libc.mallopt(_M_TRIM_THRESHOLD, 64 << 20)  # twice that, as glibc's adaptive rule sets it
        _MALLOC = None  # said afresh by the next device line
    elif _MALLOC != KEPT:
        _MALLOC = None
    try:
        yield
    finally:
        _MALLOC_DEFAULT = before
        if was_kept:
            _MALLOC = None
            keep_freed_memory()  # kept again
        elif _MALLOC != KEPT:
            _MALLOC = None


_ALONE: int | None = None  # threads for work rank 0 does while its local ranks wait (held_threads)


@contextlib.contextmanager
def held_threads(n: int, why: str, alone: int | None = None):
    """This process's intra-op threads set to n (said as `why` on the device line) for the block, and what
    was set before restored after it: for a rank run inside the calling process (stages/local.py). alone:
    the threads of the whole job, which `alone_threads` gives work this rank does while the others wait."""
    global _THREADS, _ALONE
    before = torch.get_num_threads(), _THREADS, _ALONE
    torch.set_num_threads(n)
    _THREADS, _ALONE = (n, why), alone
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        _THREADS, _ALONE = before[1:]


@contextlib.contextmanager
def alone_threads():
    """For the block, the whole job's threads where held_threads gave them (rank 0's evaluation, while the
    other local ranks sleep in a collective); a no-op otherwise."""
    if not _ALONE:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(_ALONE)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def choose_device(requested: str = "auto", threads: int | None = None) -> tuple[torch.device, str]:
    """(device, reason). auto: CUDA (also ROCm, which PyTorch exposes as cuda), then Apple MPS, then CPU.
    On the CPU the reason includes the threads thread_policy chose (applied here)."""
    if requested and requested != "auto":
        try:
            dev = torch.device(requested)
        except RuntimeError as e:
            raise DeviceError(
                f"--device {requested!r} is not a device: use auto, cpu, cuda, cuda:N or mps") from e
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError(f"--device {requested}: no CUDA/ROCm device is visible; "
                              "use --device cpu or auto")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise DeviceError(f"--device {requested}: Apple MPS is not available here; "
                              "use --device cpu or auto")
        # under torchrun each rank takes its own GPU, as auto does
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return dev, "requested" + (f"; {apply_thread_policy(threads)}" if dev.type == "cpu" else "")
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        kind = "ROCm" if torch.version.hip else "CUDA"
        return torch.device("cuda", local), f"{kind} device found: {torch.cuda.get_device_name(local)}"
    if torch.backends.mps.is_available():
        return torch.device("mps"), "Apple MPS found"
    return torch.device("cpu"), f"no GPU found; CPU, {apply_thread_policy(threads)}"


def choose_precision(device: torch.device, requested: str = "auto") -> tuple[str, str]:
    """(precision, reason): bf16 where the device supports it, else fp16 with a gradient scaler, fp32 on CPU.
    "fastest": the same, except bf16 on a CPU that multiplies bfloat16 natively (the quickstart's choice)."""
    if requested == "fp16" and device.type == "cpu":
        raise DeviceError("--precision fp16 needs a GPU (no fast fp16 matmul or grad scaler on CPU); "
                          "use fp32 or bf16")
    # auto's choice, except where a CPU multiplies bf16 itself
    if requested == "fastest" and device.type == "cpu":
        if cpu_native_bf16():
            return "bf16", ("fastest: this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX), ~30% "
                            "more tokens/s than fp32")
        return "fp32", "fastest: this CPU lacks native bfloat16 (emulated bf16 is slower), so fp32"
    if requested not in ("auto", "fastest"):
        return requested, "requested"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", "the GPU supports bfloat16 (no loss scaling needed)"
        return "fp16", "the GPU lacks bfloat16; fp16 with a gradient scaler"
    if device.type == "mps":
        return "fp32", "MPS autocast is not used by default; fp32"
    return "fp32", "CPU: fp32 is the fastest exact choice on most CPUs"


# --attention: which PyTorch SDPA kernels the model's attention may use (config.DeviceSettings.attention)
ATTENTION_CHOICES = ("auto", "cudnn", "flash", "efficient", "math")
# where each forced backend has a kernel in torch 2.13: on a CPU, math and flash (flash: no dropout there);
# efficient and cudnn are CUDA only; other devices (MPS) run math
_ATTENTION_ON = {"cpu": ("math", "flash"), "cuda": ("cudnn", "flash", "efficient", "math")}


def _sdp(name: str):
    from torch.nn.attention import SDPBackend
    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def cudnn_sdpa(device: torch.device) -> bool:
    """Whether cuDNN's fused attention can run on `device`: CUDA (not ROCm), cuDNN 9 or later, sm80+."""
    return (device.type == "cuda" and torch.version.hip is None and torch.backends.cudnn.is_available()
            and (torch.backends.cudnn.version() or 0) >= 90000
            and torch.cuda.get_device_capability(device) >= (8, 0))


def attention_backends(device: torch.device, requested: str = "auto") -> tuple[list | None, str]:
    """(backends, reason) for --attention: the SDPBackend list the model's attention runs under (in priority
    order), or None for PyTorch's own choice (no sdpa_kernel context: today's path). auto: cuDNN, then flash,
    efficient, math on a Hopper GPU (sm90+) with cuDNN attention; elsewhere PyTorch's choice. A forced backend
    the device has no kernel for is refused here, naming the setting and what to pick."""
    if requested not in ATTENTION_CHOICES:
        raise ConfigError(f"--attention (train.attention) {requested!r} is not one of "
                          f"{', '.join(ATTENTION_CHOICES)}; auto picks for the device")
    if requested == "auto":
        if cudnn_sdpa(device) and torch.cuda.get_device_capability(device) >= (9, 0):
            return ([_sdp(n) for n in ("cudnn", "flash", "efficient", "math")],
                    "auto: cuDNN attention first on this Hopper-class GPU, then flash, efficient, math")
        return None, "auto: PyTorch's own choice of SDPA kernel"
    usable = _ATTENTION_ON.get(device.type, ("math",))
    no_flash = device.type == "cuda" and not torch.backends.cuda.is_flash_attention_available()
    if requested not in usable or (requested == "cudnn" and not cudnn_sdpa(device)) or (
            requested == "flash" and no_flash):
        raise ConfigError(f"--attention (train.attention) {requested}: PyTorch {torch.__version__} has no "
                          f"{requested} attention kernel on {device}; pick auto (PyTorch's choice) or one of "
                          f"{', '.join(n for n in usable if n != 'cudnn' or cudnn_sdpa(device))}")
    return [_sdp(requested)], "requested"


CPU_BF16_ENV = "CODEFORGE_CPU_BF16"  # 1: act as if the CPU had native bf16; 0: as if not; unset: ask the CPU


def cpu_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX): there bf16 autocast trains ~30%
    faster than fp32 (docs/LOG.md#2026-11-23-quality-per-minute-exploration); elsewhere it is emulated and
    slower.

    CODEFORGE_CPU_BF16=1 or 0 overrides the answer, so the choices that hang on it (the quickstart's
    precision) can be run and tested both ways on any CPU; bf16 on a CPU without it is slow, not wrong."""
    forced = os.environ.get(CPU_BF16_ENV, "").strip().lower()
    if forced in ("1", "true", "on", "yes"):
        return True
    if forced in ("0", "false", "off", "no"):
        return False
    if forced:
        raise DeviceError(
            f"{CPU_BF16_ENV}={forced!r}: use 1 (bf16 on), 0 (bf16 off) or leave it unset (ask the CPU)")
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private helpers of torch.cpu; absent: assume no
        return False


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def peak_flops(device: torch.device) -> float | None:
    """Peak dense FLOP/s of a CUDA/ROCm device from the table, or None (then no MFU is printed)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key] * 1e12
    return None


_MATMUL_RATE: dict = {}


def matmul_flops(device: torch.device, precision: str = "fp32", seconds: float = 0.3) -> float:
    """FLOP/s of square matrix products on `device` in `precision` with this process's threads, measured
    once per process (about `seconds`): what a training estimate can be made from before any step runs."""
    key = (str(device), precision, torch.get_num_threads())
    if key not in _MATMUL_RATE:
        n = 512 if device.type == "cpu" else 4096
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        # never the global generator: a resumed run's draws stay its own
        g = torch.Generator(device).manual_seed(0)
        a = torch.randn(n, n, device=device, generator=g).to(dtype)
        b = torch.randn(n, n, device=device, generator=g).to(dtype)
        a @ b  # warm-up
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or done < 2:
            a @ b
            done += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _MATMUL_RATE[key] = 2 * n**3 * done / (time.perf_counter() - t0)
    return _MATMUL_RATE[key]


def memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return 0.0
