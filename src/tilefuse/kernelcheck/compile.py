"""Compile one kernel variant for a GPU target on any machine, and read what the compiler made.

``triton.compile`` runs the whole pipeline (TTIR -> TTGIR -> LLVM IR -> PTX -> cubin, the
cubin from the ``ptxas`` bundled with Triton) for any ``GPUTarget`` without a GPU. From the
result this module extracts:

* registers, spill bytes and stack frame, from the ``ptxas -v`` report of that very compile;
* shared memory (bytes the kernel asks for at launch) and tensor-memory columns (sm_100);
* the dots of the kernel (TTIR) and what Triton turned them into (TTGIR): Hopper
  ``warp_group_dot`` (wgmma), Blackwell ``tc_gen5_mma`` / ``tc_gen5_mma_scaled`` (tcgen05),
  or a ``tt.dot`` left as is (an ``mma.sync`` or FMA loop);
* static instruction counts of the PTX and of the SASS (each instruction counted once where it
  appears in the code, not per execution).

Compilation needs real ``JITFunction`` objects, which ``TRITON_INTERPRET=1`` (set by the test
setup on CPU machines) replaces at import time. :func:`compile_many` therefore compiles in
worker processes started without that variable; :func:`compile_variant` works in a process
whose kernels were imported without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import IO, Callable

from tilefuse.kernelcheck.variants import TL_DTYPE_PREFIX, Variant

TARGETS = {"sm_90a": 90, "sm_100a": 100}

# --------------------------------------------------------------------------------------
# Instruction classes. PTX: by opcode prefix. SASS: by opcode (the mnemonic before the
# first dot).
# --------------------------------------------------------------------------------------
PTX_CLASSES = {
    "wgmma": ("wgmma.mma_async",),
    "tcgen05.mma": ("tcgen05.mma",),
    "mma.sync": ("mma.sync",),
    "fma": ("fma.",),
    "ld.global": ("ld.global",),
    "st.global": ("st.global",),
    "ld.shared": ("ld.shared",),
    "st.shared": ("st.shared",),
    "cp.async.bulk.tensor": ("cp.async.bulk.tensor",),
    # waits for TMA stores to be read out of shared memory (where a kernel blocks on its stores)
    "bulk.wait.read": ("cp.async.bulk.wait_group.read",),
    "cp.async": ("cp.async.ca", "cp.async.cg"),
    "ldmatrix": ("ldmatrix",),
    "tcgen05.ld": ("tcgen05.ld",),
    "tcgen05.cp": ("tcgen05.cp",),
    "ld.local": ("ld.local",),
    "st.local": ("st.local",),
}
SASS_CLASSES = {
    "GMMA": ("HGMMA", "QGMMA", "IGMMA", "BGMMA"),  # wgmma
    "UTCMMA": ("UTCHMMA", "UTCQMMA", "UTCOMMA", "UTCIMMA", "UTCMMA"),  # tcgen05.mma
    "MMA.SYNC": ("HMMA", "IMMA", "QMMA", "DMMA", "BMMA"),  # warp-level mma.sync
    "FFMA": ("FFMA", "FFMA2"),
    "LDG": ("LDG",),
    "STG": ("STG",),
    "LDS": ("LDS",),
    "STS": ("STS",),
    "LDSM": ("LDSM",),
    "TMA": ("UTMALDG", "UTMASTG", "UBLKCP"),
    "LDL": ("LDL",),
    "STL": ("STL",),
}
# TTGIR ops a dot becomes. A ``tt.dot`` / ``tt.dot_scaled`` still present in TTGIR was not
# turned into a wgmma or tcgen05 MMA (it lowers to mma.sync or to an FMA loop).
_MMA_OPS = ("ttng.warp_group_dot", "ttng.tc_gen5_mma_scaled", "ttng.tc_gen5_mma")
_DOT_OPS = ("tt.dot_scaled", "tt.dot")


@dataclasses.dataclass
class KernelReport:
    """What one compile of one variant for one target produced (sizes in bytes)."""

    kernel: str
    variant: str
    target: str
    ok: bool
    error: str | None = None
    num_warps: int = 0
    num_stages: int = 0
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_frame: int | None = None
    shared: int | None = None
    tmem_columns: int | None = None
    dots: dict[str, int] = dataclasses.field(default_factory=dict)  # TTIR: tt.dot / tt.dot_scaled
    lowered: dict[str, int] = dataclasses.field(default_factory=dict)  # TTGIR: MMA ops and dots left
    ptx: dict[str, int] = dataclasses.field(default_factory=dict)
    sass: dict[str, int] = dataclasses.field(default_factory=dict)
    sass_opcodes: dict[str, int] = dataclasses.field(default_factory=dict)
    compile_seconds: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KernelReport:
        return cls(**d)


# --------------------------------------------------------------------------------------
# Parsers (pure functions of compiler text; unit-tested on their own)
# --------------------------------------------------------------------------------------
_PTX_INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)")


def count_ptx(ptx: str) -> dict[str, int]:
    """Static counts of :data:`PTX_CLASSES` in PTX text (directives, labels, comments skipped)."""
    counts = dict.fromkeys(PTX_CLASSES, 0)
    for line in ptx.splitlines():
        s = line.strip()
        if not s or s.startswith(("//", ".", "$", "{", "}")) or s.endswith(":"):
            continue
        m = _PTX_INSTR.match(s)
        if not m:
            continue
        op = m.group(1)
        for name, prefixes in PTX_CLASSES.items():
            if op.startswith(prefixes):
                counts[name] += 1
    return counts


_SASS_INSTR = re.compile(r"^(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_SASS_ADDR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*")


def sass_opcodes(sass: str) -> Counter:
    """Opcode histogram of SASS as ``cuobjdump -sass`` prints it (``/*0040*/  OPCODE ...``) or
    as Triton's ``asm["sass"]`` does (``<control>\tOPCODE ...``); other lines are skipped."""
    hist: Counter = Counter()
    for line in sass.splitlines():
        addr = _SASS_ADDR.match(line)
        if addr:
            text = line[addr.end():]
        elif "\t" in line:
            text = line.split("\t", 1)[1]
        else:
            continue
        m = _SASS_INSTR.match(text.strip())
        if m:
            hist[m.group(1)] += 1
    return hist


def disassemble(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin, with the cuobjdump bundled in Triton."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], check=True, capture_output=True,
                              text=True).stdout


def count_sass(hist: Counter) -> dict[str, int]:
    return {name: sum(hist.get(op, 0) for op in ops) for name, ops in SASS_CLASSES.items()}


def count_ops(ir: str, names: tuple[str, ...]) -> dict[str, int]:
    """Occurrences of MLIR ops ``names`` used as operations (``= op`` or a statement start)."""
    return {n: len(re.findall(r"(?:^|=)\s*" + re.escape(n) + r"(?![\w.])", ir, flags=re.MULTILINE)) for n in names}


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str) -> dict[str, int]:
    """``ptxas -v`` report -> registers, stack_frame, spill_stores, spill_loads (one kernel)."""
    regs = _PTXAS_REGS.search(log)
    frame = _PTXAS_FRAME.search(log)
    if not regs or not frame:
        raise ValueError(f"no register/spill lines in the ptxas report: {log.strip()[:500]!r}")
    return {"registers": int(regs.group(1)), "stack_frame": int(frame.group(1)),
            "spill_stores": int(frame.group(2)), "spill_loads": int(frame.group(3))}


# --------------------------------------------------------------------------------------
# Compiling
# --------------------------------------------------------------------------------------
def resolve_kernel(path: str):
    """``"package.module:name"`` -> the ``@triton.jit`` object."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"kernel path must look like 'package.module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def _capture_fd2():
    """Collect what native code writes to stderr (MLIR diagnostics) while compiling."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        box = {"text": ""}
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box["text"] = tmp.read().decode(errors="replace")


def compile_variant(variant: Variant, target: str, sass: bool = True) -> KernelReport:
    """Compile ``variant`` for ``target`` ("sm_90a" or "sm_100a") in this process.

    ``sass``: also disassemble the cubin (``cuobjdump``, about 0.3 s) for the SASS counts.

    Errors of the kernel (it does not compile) are returned in the report; errors of the
    setup (an interpreted kernel, an unknown target) raise.

    Raises:
        ValueError: unknown target.
        RuntimeError: the kernel object is not a ``JITFunction`` (imported under
            ``TRITON_INTERPRET=1``).
    """
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if target not in TARGETS:
        raise ValueError(f"target: expected one of {sorted(TARGETS)}, got {target!r}")
    report = KernelReport(kernel=variant.kernel, variant=variant.name, target=target, ok=False,
                          num_warps=variant.num_warps, num_stages=variant.num_stages)
    fn = resolve_kernel(variant.function)
    if not isinstance(fn, JITFunction):
        raise RuntimeError(f"{variant.function} is a {type(fn).__name__}, not a JITFunction: compile in a process "
                           "that imported the kernels without TRITON_INTERPRET (compile_many does)")
    declared = set(variant.signature) | set(variant.constexprs)
    if declared != set(fn.arg_names):
        missing = [a for a in fn.arg_names if a not in declared]
        extra = sorted(declared - set(fn.arg_names))
        report.error = f"the variant's arguments do not match {variant.function}: missing {missing}, unknown {extra}"
        return report
    signature = {name: variant.signature.get(name, "constexpr") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in variant.aligned}
    constexprs = {k: tl.dtype(v[len(TL_DTYPE_PREFIX):]) if isinstance(v, str) and v.startswith(TL_DTYPE_PREFIX) else v
                  for k, v in variant.constexprs.items()}
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn, signature, constexprs, attrs)
    else:
        src = ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    if variant.maxnreg is not None:
        options["maxnreg"] = variant.maxnreg

    t0 = time.perf_counter()
    stdout = io.StringIO()
    with knobs.compilation.scope(), knobs.nvidia.scope():
        # Always run ptxas (no cache hit) so that its -v report, printed by Triton when
        # dump_ptxas_log is on, is there to read.
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        try:
            with _capture_fd2() as native_err, contextlib.redirect_stdout(stdout):
                compiled = triton.compile(src, target=GPUTarget("cuda", TARGETS[target], 32), options=options)
        except Exception as e:  # the kernel failed to compile: that is the finding
            detail = "\n".join(ln for ln in native_err["text"].splitlines() if "error" in ln.lower())
            report.error = f"{type(e).__name__}: {str(e).strip()[:2000]}" + (f"\n{detail[:2000]}" if detail else "")
            report.compile_seconds = time.perf_counter() - t0
            return report
    report.compile_seconds = time.perf_counter() - t0

    meta = compiled.metadata
    report.shared = int(meta.shared)
    report.tmem_columns = int(getattr(meta, "tmem_size", 0) or 0)
    try:
        report.__dict__.update(parse_ptxas_log(stdout.getvalue()))
    except ValueError as e:
        report.error = str(e)
        return report
    if "ttir" in compiled.asm:
        report.dots = count_ops(compiled.asm["ttir"], _DOT_OPS)
    else:  # Gluon starts at TTGIR: its MMAs are written out, and they are the dots
        report.dots = {op: n for op, n in count_ops(compiled.asm["ttgir"], _MMA_OPS).items() if n}
    report.lowered = count_ops(compiled.asm["ttgir"], _MMA_OPS + _DOT_OPS)
    report.ptx = count_ptx(compiled.asm["ptx"])
    if sass:
        hist = sass_opcodes(disassemble(compiled.asm["cubin"]))
        report.sass = count_sass(hist)
        report.sass_opcodes = dict(sorted(hist.items()))
    report.ok = True
    return report


def compile_many(items: list[tuple[Variant, str]], jobs: int = 1, sass: bool = True, timeout: float = 1800.0,
                 on_report: Callable[[int, KernelReport], None] | None = None,
                 compile_timeout: float = 600.0) -> list[KernelReport]:
    """Compile ``(variant, target)`` pairs in ``jobs`` worker processes; reports in input order.

    Workers run ``python -m tilefuse.kernelcheck.compile`` with this process's ``sys.path``,
    without ``TRITON_INTERPRET``, and with a private Triton cache directory. Each writes a
    report as soon as it has one, so ``on_report(index into items, report)`` is called for each
    pair while the others still compile (in completion order). A compile that takes longer
    than ``compile_timeout`` seconds (a compiler pass that never ends) is a failed report
    saying so; its worker is replaced for the pairs after it.

    Raises:
        RuntimeError: a worker failed (the message carries its stderr), or all the compiles
            took longer than ``timeout``.
    """
    if not items:
        return []
    jobs = max(1, min(jobs, len(items)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    results: list[KernelReport | None] = [None] * len(items)
    with tempfile.TemporaryDirectory(prefix="tilefuse-kernelcheck-") as tmp:
        env["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton-cache")
        started = 0

        def start(idx: list[int]) -> _Worker:
            nonlocal started
            inp, out = os.path.join(tmp, f"in{started}.json"), os.path.join(tmp, f"out{started}.jsonl")
            jobs_in = [{"variant": items[i][0].to_dict(), "target": items[i][1]} for i in idx]
            with open(inp, "w") as f:
                json.dump({"sys_path": sys.path, "sass": sass, "jobs": jobs_in}, f)
            open(out, "w").close()
            err = open(os.path.join(tmp, f"err{started}.txt"), "w+")
            started += 1
            p = subprocess.Popen([sys.executable, "-m", "tilefuse.kernelcheck.compile", inp, out],
                                 env=env, stdout=subprocess.DEVNULL, stderr=err)
            return _Worker(p, idx, open(out), err, since=time.monotonic())

        def report(i: int, r: KernelReport) -> None:
            results[i] = r
            if on_report is not None:
                on_report(i, r)

        def collect(worker: _Worker) -> None:
            for line in worker.new_lines():
                report(worker.idx[worker.done], KernelReport.from_dict(json.loads(line)))
                worker.done += 1
                worker.since = time.monotonic()

        def stop(worker: _Worker) -> None:
            if worker.proc.poll() is None:
                worker.proc.kill()
                worker.proc.wait()
            worker.out.close()
            worker.err.close()

        workers = [start(list(range(i, len(items), jobs))) for i in range(jobs)]
        deadline = time.monotonic() + timeout
        try:
            while any(w.proc.poll() is None for w in workers):
                for k, w in enumerate(workers):
                    if w.out.closed:  # timed out on its last pair
                        continue
                    collect(w)
                    if w.proc.poll() is None and time.monotonic() - w.since > compile_timeout:
                        variant, target = items[w.idx[w.done]]
                        report(w.idx[w.done], KernelReport(
                            variant.kernel, variant.name, target, ok=False, num_warps=variant.num_warps,
                            num_stages=variant.num_stages, compile_seconds=compile_timeout,
                            error=f"did not compile within {compile_timeout:.0f} s (a compiler pass that never ends?)"))
                        stop(w)
                        workers[k] = start(w.idx[w.done + 1:]) if w.done + 1 < len(w.idx) else w
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kernel compiles did not finish within {timeout:.0f} s")
                time.sleep(0.1)
            for w in workers:
                if w.out.closed:
                    continue
                collect(w)
                w.err.seek(0)
                log = w.err.read()
                if w.proc.returncode != 0 or w.done != len(w.idx):
                    raise RuntimeError(f"kernel compile worker failed ({w.proc.returncode}):\n{log[-4000:]}")
        finally:
            for w in workers:
                if not w.out.closed:
                    stop(w)
    return results  # type: ignore[return-value]


@dataclasses.dataclass
class _Worker:
    """One compile process of :func:`compile_many` and how far its report file has been read."""

    proc: subprocess.Popen
    idx: list[int]
    out: IO[str]
    err: IO[str]
    since: float  # when it started or last reported
    done: int = 0
    partial: str = ""

    def new_lines(self) -> list[str]:
        """Complete lines the worker has written since the last call (a line being written waits)."""
        text = self.partial + self.out.read()
        *lines, self.partial = text.split("\n")
        return [ln for ln in lines if ln]


def _worker(argv: list[str]) -> int:
    inp, out = argv
    with open(inp) as f:
        job = json.load(f)
    for p in job["sys_path"]:
        if p not in sys.path:
            sys.path.append(p)
    with open(out, "w") as f:
        for j in job["jobs"]:
            report = compile_variant(Variant.from_dict(j["variant"]), j["target"], job["sass"])
            f.write(json.dumps(report.to_dict()) + "\n")
            f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
