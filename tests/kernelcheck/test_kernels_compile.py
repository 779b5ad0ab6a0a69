"""Every registered kernel configuration compiles for sm_90a and sm_100a and passes the checks
(fast MMA for every dot, no spills, shared memory within the limit), except the spills listed
in ``tilefuse.kernelcheck.known_issues``, each within its budget.

The compiles run in worker processes without ``TRITON_INTERPRET`` (``compile_many``); one test
per (kernel, target, first word of the configuration, slice of at most ``_GROUP_SIZE``) keeps
the groups small enough to spread evenly over xdist workers. A session not split by xdist (the
README's test command on a GPU image without it) compiles its selected groups once, in one
pool of a worker per core, at its first group.
"""

from __future__ import annotations

import fnmatch
import os

import pytest

from tilefuse.kernelcheck import checks, known_issues, variants
from tilefuse.kernelcheck.compile import KernelReport, compile_many
from tilefuse.kernelcheck.known_issues import KNOWN_SPILLS

ALL = variants.variants()


def _part(v: variants.Variant) -> str:
    return v.name.split(" ")[0].split("[")[0]


_GROUP_SIZE = 8
_by_part: dict[tuple[str, str, str], list[variants.Variant]] = {}
for _v in ALL:
    for _t in _v.targets:
        _by_part.setdefault((_v.kernel, _t, _part(_v)), []).append(_v)
GROUPS: dict[tuple[str, str, str, str], list[variants.Variant]] = {
    (*key, str(i // _GROUP_SIZE)): vs[i:i + _GROUP_SIZE]
    for key, vs in _by_part.items() for i in range(0, len(vs), _GROUP_SIZE)
}
_reports: dict[tuple[str, str, str], KernelReport] = {}  # (kernel, variant name, target) -> report


def _compile_group(group, session) -> list[KernelReport]:
    """The group's reports: under xdist compiled on its share of the cores, else from one pool
    over every group this session selected (filled at its first group)."""
    items = [(v, group[1]) for v in GROUPS[group]]
    # TILEFUSE_TEST_COMPILE_JOBS: the pool's size where several pytest processes share the cores
    cores = int(os.environ.get("TILEFUSE_TEST_COMPILE_JOBS", 0)) or os.cpu_count() or 1
    if os.environ.get("PYTEST_XDIST_WORKER"):
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        return compile_many(items, jobs=max(1, cores // workers), sass=False)
    if not _reports:
        selected = [it.callspec.params["group"] for it in session.items
                    if getattr(it, "originalname", None) == "test_compiles_on_the_fast_path"]
        every = [(v, g[1]) for g in selected for v in GROUPS[g]]
        for (v, t), r in zip(every, compile_many(every, jobs=cores, sass=False)):
            _reports[v.kernel, v.name, t] = r
    return [_reports[v.kernel, v.name, t] for v, t in items]


def _named(entry, kernel: str, target: str) -> set[str]:
    """The registry's configurations of (kernel, target) that a known issue names."""
    return {v.name for vs in _by_part.values() for v in vs
            if v.kernel == kernel and target in v.targets and fnmatch.fnmatch(v.name, entry.configuration)}


def _stale(group, reports: list[KernelReport]) -> list:
    """Known issues that accept none of the configurations they name. An entry whose
    configurations span several groups is judged on all of them: in a pooled session by the
    group of its first configuration, under xdist (where a process sees its own groups only)
    not here but by ``tilefuse kernels``, which compiles the whole registry."""
    kernel, target = group[:2]
    mine = {v.name for v in GROUPS[group]}
    out = []
    for e in known_issues.stale(reports):
        if _named(e, kernel, target) <= mine:
            out.append(e)
    for e in {e for r in reports for e in known_issues.matching(r)}:
        named = _named(e, kernel, target)
        if named <= mine or min(named) not in mine:
            continue
        pooled = [_reports.get((kernel, n, target)) for n in sorted(named)]
        if all(pooled) and e in known_issues.stale(pooled):
            out.append(e)
    return out


def test_registry_covers_every_kernel():
    assert {v.kernel for v in ALL} == set(variants.kernel_names())
    assert {"indexer.prefill", "indexer.prefill_sm100", "indexer.paged", "tp.gemm"} <= set(variants.kernel_names())


def test_known_issues_name_registered_configurations():
    for kernel, target, pattern, _, why, _ in KNOWN_SPILLS:
        names = [v.name for v in ALL if v.kernel == kernel and any(fnmatch.fnmatch(t, target) for t in v.targets)]
        assert any(fnmatch.fnmatch(n, pattern) for n in names), \
            f"known issue {kernel} {target} {pattern!r} ({why}) matches no configuration: update or delete it"


def _report(variant: str, spill: int, **kw) -> KernelReport:
    fields = dict(kernel="indexer.prefill", variant=variant, target="sm_90a", ok=True, registers=255,
                  spill_stores=spill, spill_loads=spill, stack_frame=spill, shared=0)
    return KernelReport(**{**fields, **kw})


def test_known_issues_accept_spills_within_budget_only():
    listed = "mxfp8 D128 H64 full+clean 64x128 w4s2 bf16-recompute"
    other = listed.replace("mxfp8", "mxfp4")  # matches no entry of its target
    [entry] = [e for e in KNOWN_SPILLS if e.configuration == "mxfp8 * full*"]
    assert entry.budget == 128
    ok = _report(listed, 64, sass={"LDL": 16, "STL": 16})  # the SASS's local accesses are the same spill
    assert known_issues.accepted_by(ok) == [entry]
    assert not known_issues.accepted_by(_report(listed, 129))  # over the budget
    assert not known_issues.accepted_by(_report(listed, 64, shared=300 * 1024))  # and another failure
    assert not known_issues.accepted_by(_report(listed, 64, target="sm_100a", kernel="tp.gemm"))
    assert not known_issues.accepted_by(_report(other, 64))  # not listed
    assert not known_issues.accepted_by(_report(listed, 0))  # passes: nothing to accept
    assert known_issues.stale([ok]) == [] and known_issues.stale([_report(listed, 0)]) == [entry]
    assert known_issues.stale([_report(other, 0)]) == []  # names no report


@pytest.mark.parametrize("group", sorted(GROUPS), ids=lambda g: "-".join(g))
def test_compiles_on_the_fast_path(group, request):
    kernel, target = group[:2]
    reports = _compile_group(group, request.session)
    unexpected = []
    for r in reports:
        fails = checks.failures(r)
        if not fails or known_issues.accepted_by(r):
            continue
        budget = max((e.budget for e in known_issues.matching(r)), default=None)
        budget = f" (known issue, budget {budget} B)" if budget is not None else ""
        unexpected.append(f"{r.variant}{budget}: {'; '.join(fails)}")
    stale = _stale(group, reports)
    assert not unexpected, f"{kernel} on {target}:\n  " + "\n  ".join(unexpected)
    assert not stale, (f"{kernel} on {target}: known issues that no longer occur here, tighten or delete them in "
                       f"tilefuse/kernelcheck/known_issues.py: {[e.configuration for e in stale]}")


def test_gluon_prefill_keeps_every_wgmma_in_the_sass():
    """ptxas once deleted the last head's wgmma of the relu_via_abs loop (LLVM had turned that
    head's abs into an integer AND on the wait's registers); the head then added nothing.
    With the SASS disassembled, the GMMA count must match the PTX's wgmma count."""
    picked = [v for v in ALL if v.kernel == "indexer.prefill_gluon" and v.name.startswith("fp8e4nv D128 H64 full+clean")
              and "out=" not in v.name]
    assert any(" abs" in v.name for v in picked)
    reports = compile_many([(v, "sm_90a") for v in picked], jobs=2, sass=True)
    assert all(r.sass_opcodes for r in reports)
    dropped = [f"{r.variant}: {f}" for r in reports for f in checks.failures(r) if "dropped" in f]
    assert not dropped, dropped


def test_gluon_gemm_rs_keeps_every_wgmma_and_defers_the_store_wait():
    """The Gluon push kernel: ptxas keeps every wgmma, and the pushed tile's TMA store is not
    waited for in the epilogue that issues it (the point of the kernel): the PTX holds exactly
    one wait for the previous store in each of the two epilogues (pushed tile, own tile),
    before the buffer is rewritten, the one behind a program's first push (its owner needs it
    in the first wave) and the final one after the tile loop."""
    picked = [v for v in ALL if v.kernel == "tp.rs_gluon" and " kn 128x256" in v.name and "trace" not in v.name]
    assert len(picked) == 1
    reports = compile_many([(picked[0], "sm_90a")], jobs=1, sass=True)
    assert reports[0].ok and reports[0].sass_opcodes
    assert not [f for f in checks.failures(reports[0]) if "dropped" in f]
    assert reports[0].ptx["bulk.wait.read"] == 4
