"""Probe of the paged layout's own ceiling: stream 32768 random 64-token FP8 pages (D = 128,
page stride 64 * 132 bytes, one dot per page, no request structure, no epilogue) with pointer
gathers and with TMA loads, over programs per SM x pipeline stages x shuffled / identity block
tables, against the copy ceiling measured in the same run. The measurement behind the paged
kernel's redesign (``benchmarks/NOTES.md``, paged round 2).

    python benchmarks/paged_probe.py
"""

import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tilefuse.bench import ceilings, timing

D, KV = 128, 64
PAGE = KV * (D + 4)


@triton.jit
def stream_pages_kernel(kv_ptr, kv_desc, bt_ptr, q_ptr, out_ptr, n_tiles, PAGE_BYTES: tl.constexpr,
                        USE_TMA: tl.constexpr, STAGES: tl.constexpr):
    """Programs take pages round-robin; per page one [64 keys, 128] x [128, 64] dot."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    r = tl.arange(0, 64)
    d = tl.arange(0, 128)
    q = tl.load(q_ptr + r[:, None] * 128 + d[None, :])
    acc = tl.zeros((64, 64), tl.float32)
    for t in tl.range(pid, n_tiles, nprog, num_stages=STAGES):
        if USE_TMA:
            k = kv_desc.load([tl.load(bt_ptr + t), 0, 0]).reshape(64, 128)
        else:  # the block-table entry loaded per key row, as the decode kernel gathers
            page = tl.load(bt_ptr + t + r * 0).to(tl.int64)
            k = tl.load(kv_ptr + (page * PAGE_BYTES + r * 128)[:, None] + d[None, :])
        acc += tl.dot(k, tl.trans(q))
    tl.store(out_ptr + pid * 64 + r, tl.sum(acc, axis=1))


def main():
    n_pages = 256 * 128
    kv = torch.randint(-60, 60, (n_pages * PAGE,), dtype=torch.int8, device="cuda").view(torch.float8_e4m3fn)
    q = torch.randn(64, 128, device="cuda").to(torch.float8_e4m3fn)
    rand = torch.randperm(n_pages, device="cuda", dtype=torch.int32)
    ident = torch.arange(n_pages, device="cuda", dtype=torch.int32)
    desc = TensorDescriptor(kv, [n_pages, 64, 128], [PAGE, 128, 1], [1, 64, 128])
    nbytes = n_pages * KV * D
    fns = {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(sms * 16 * 64, device="cuda")
    for tname, bt in (("rand", rand), ("ident", ident)):
        for progs in (1, 2, 4, 8):
            for st in (3, 4, 6):
                for kind, tma in (("ptr", False), ("tma", True)):
                    fns[f"{kind} {tname} p{progs} st{st}"] = (
                        lambda bt=bt, p=progs, s=st, tma=tma: stream_pages_kernel[(sms * p,)](
                            kv, desc, bt, q, out, n_pages, PAGE, tma, s, num_warps=4))
    ok = {}
    for name, fn in fns.items():
        try:
            fn()
            torch.cuda.synchronize()
            ok[name] = fn
        except Exception as e:
            print(name, "FAILED", type(e).__name__, str(e)[:200])
    stats = timing.time_graph(ok, calls=5, samples=10)
    copy = ceilings.ceiling_value(ceilings.measure_ceilings(), "copy")
    print(f"copy {copy:.2f} TB/s; {nbytes/1e6:.0f} MB of values")
    for name, s in stats.items():
        print(f"{name:24s} {s.median_us:8.1f} us {nbytes / s.median_us / 1e6:5.2f} TB/s")


if __name__ == "__main__":
    sys.exit(main())
