"""tilefuse.warmup: every kernel variant a model configuration can use, run once at start-up;
on a GPU, no compile afterwards over a random sequence of shapes."""

from __future__ import annotations

import pytest
import torch

import tilefuse
from tilefuse import _jit
from tilefuse.indexer import paged, prefill
from tilefuse.indexer import warmup as warmup_mod
from tilefuse.indexer import windows as W

from ..conftest import DEVICE, ON_GPU


def test_warmup_runs_the_prefill_calls_and_reports(record_launches):
    from tilefuse.indexer import _prefill_kernel as kern

    main = record_launches(kern, "prefill_logits_kernel")
    few = record_launches(kern, "prefill_heads_on_n_kernel")
    model = tilefuse.IndexerModel(fmt="fp8", num_heads=8, head_dim=64)
    report = tilefuse.warmup(model, device=DEVICE, decode=False)
    # The few-row path (at most 32 rows: 4 rows a program; on Hopper GPUs also the few-row
    # calls, 16 rows a program), and the many-row one (on Hopper GPUs the Gluon kernel, in two
    # configurations: small calls, prefill.SMALL_CALL, and the rest).
    hopper = ON_GPU and torch.cuda.get_device_capability()[0] == 9
    assert report.calls == {"prefill": 4 if hopper else 2} and report.seconds > 0
    assert len(few) == (2 if hopper else 1) and len(main) == (0 if hopper else 1)
    if not ON_GPU:
        assert report.compiles == []  # the interpreter never compiles


def test_warmup_asks_the_paged_op_when_it_offers_warmup_calls(monkeypatch):
    seen = []

    def paged_calls(fmt, num_heads, head_dim, block_kv, next_n, weights_dtype, logits_dtype, clean_logits, device):
        seen.append((fmt, num_heads, head_dim, block_kv, next_n, weights_dtype, logits_dtype, clean_logits))
        return [lambda: None, lambda: None]

    monkeypatch.setattr(paged, "warmup_calls", paged_calls, raising=False)
    monkeypatch.setattr(prefill, "warmup_calls", lambda *a: [])
    model = tilefuse.IndexerModel(fmt="mxfp4", num_heads=16, head_dim=128, block_kv=32, next_n=2)
    report = tilefuse.warmup(model, device=DEVICE)
    assert report.calls == {"prefill": 0, "decode": 2}
    assert seen == [("mxfp4", 16, 128, 32, 2, torch.float32, torch.float32, False)]


def test_warmup_rejects_what_is_not_a_model():
    with pytest.raises(TypeError, match="IndexerModel"):
        tilefuse.warmup({"fmt": "fp8"})
    with pytest.raises(ValueError, match="fmt"):
        warmup_mod.warmup_calls(tilefuse.IndexerModel(fmt="int4"), DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("model", [
    tilefuse.IndexerModel(),  # DeepSeek-V3.2's indexer as engines call prefill: FP8, no clean
    tilefuse.IndexerModel(clean_logits=True, logits_dtype=torch.bfloat16),
    tilefuse.IndexerModel(fmt="mxfp4", compressed=True),
    tilefuse.IndexerModel(fmt="mxfp8", num_heads=32),
], ids=str)
def test_no_compile_after_warmup_over_random_shapes(model):
    """After warm-up, 24 random (S_q, S_k) with random windows, padded rows and sliced inputs
    compile nothing."""
    tilefuse.warmup(model, decode=False)
    g = torch.Generator().manual_seed(19)
    q_full, kv_full = prefill._zero_inputs(model.fmt, 2048, 8192, model.num_heads, model.head_dim, "cuda")
    w_full = torch.randn(2048, model.num_heads + 5, device="cuda").to(model.weights_dtype)
    with _jit.count_compiles() as log:
        for _ in range(24):
            s_q = int(torch.randint(1, 2048, (1,), generator=g))
            s_k = int(torch.randint(1, 8192, (1,), generator=g))
            start = int(torch.randint(0, 8192 - s_k + 1, (1,), generator=g))
            ks, ke = W.random_windows(s_q, s_k, generator=g, device="cuda")
            q = (q_full[0][:s_q], None if q_full[1] is None else q_full[1][:s_q])
            kv = (kv_full[0][start:start + s_k], kv_full[1][start:start + s_k])
            tilefuse.fp8_fp4_mqa_logits(q, kv, w_full[:s_q, 3:3 + model.num_heads], ks, ke, model.clean_logits,
                                        s_k if model.compressed else 0, model.logits_dtype)
        torch.cuda.synchronize()
    assert log.count == 0, f"compiled after warm-up: {log.kernels()}"


def test_topk_warmup_runs_every_merge_variant(monkeypatch):
    """With ``topk``, the warm-up runs the fused ops so that every merge variant launches: one
    chunk, and first / middle / last chunks, each with and without values, for prefill windows
    and both decode length layouts."""
    from tilefuse import _jit
    from tilefuse.indexer import _topk_kernel as kern
    from tilefuse.indexer import topk  # noqa: F401  (its launchers made from the real kernel first)

    real = kern.topk_merge_chunk_kernel
    seen = set()

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.add((kw["MODE"], kw["FIRST"], kw["FINAL"], kw["WRITE_VALUES"]))
                return real[grid](*args, **kw)
            return launch

    spy = Spy()
    monkeypatch.setattr(kern, "topk_merge_chunk_kernel", spy)
    model = tilefuse.IndexerModel(fmt="fp8", num_heads=8, head_dim=64, block_kv=32, topk=16)
    with _jit.redirected(real, spy):  # the op launches through tilefuse._jit.Launcher
        report = tilefuse.warmup(model, device=DEVICE)
    assert report.calls["prefill_topk"] == len(prefill.warmup_sizes("fp8", 8, 64, torch.float32,
                                                                      torch.device(DEVICE))) + 4
    assert report.calls["decode_topk"] == 18  # 8 chunked, 8 whole rows (short and long), 2 with indices
    stages = {(True, True), (True, False), (False, False), (False, True)}
    want = {(mode, first, final, values) for mode in (kern.WIN_PREFILL, kern.WIN_DECODE_1D, kern.WIN_DECODE_2D)
            for first, final in stages for values in (False, True)}
    assert seen == want
    assert "prefill_topk" not in tilefuse.warmup(tilefuse.IndexerModel(num_heads=8, head_dim=64), device=DEVICE,
                                                 decode=False).calls


@pytest.mark.parametrize("next_n", [1, 3])
def test_topk_warmup_runs_the_last_step_of_whole_rows(next_n, monkeypatch):
    """Decode rows taken whole end in the final merge (after the passes over group maxima): the
    warm-up runs it with and without values, over both length layouts, after passes that keep
    their maxima (long rows) and passes that read the keys again (short rows)."""
    from tilefuse import _jit
    from tilefuse.indexer import _topk_kernel as kern
    from tilefuse.indexer import topk as topk_op

    seen = set()

    def spy_of(real, what):
        class Spy:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    seen.add(what(kw))
                    return real[grid](*args, **kw)
                return launch
        return Spy()

    merge, passes = kern.topk_merge_chunk_kernel, kern.topk_rows_pass_kernel
    with (_jit.redirected(merge, spy_of(merge, lambda kw: ("merge", kw["MODE"], kw["WRITE_VALUES"], kw["RESET"]))),
          _jit.redirected(passes, spy_of(passes, lambda kw: ("pass", kw["MODE"], kw["KEEP"])))):
        for call in topk_op.warmup_calls("fp8", 8, 64, 48, torch.float32, torch.float32, DEVICE, 32, next_n,
                                         prefill_calls=False)["decode_topk"]:
            call()
    modes = (kern.WIN_DECODE_1D, kern.WIN_DECODE_2D)
    reset = 2 if topk_op._ACROSS_GROUP_MAXIMA else 1  # the passes over group maxima, or over the keys
    assert {("merge", m, v, reset) for m in modes for v in (False, True)} <= seen
    assert {("pass", m, keep) for m in modes for keep in (False, True)} <= seen


@pytest.mark.gpu
@pytest.mark.parametrize("model", [
    tilefuse.IndexerModel(topk=2048),
    tilefuse.IndexerModel(fmt="mxfp4", topk=2048, next_n=2),
], ids=str)
def test_no_compile_after_topk_warmup_over_random_shapes(model):
    """After warm-up, fused top-k calls of random sizes (prefill S_q, S_k; decode B, lengths in
    1-D and 2-D, max_context_len) compile nothing."""
    from tilefuse.indexer import topk as topk_op

    tilefuse.warmup(model)
    g = torch.Generator().manual_seed(23)
    q_full, kv_full = prefill._zero_inputs(model.fmt, 1024, 40000, model.num_heads, model.head_dim, "cuda")
    w_full = torch.randn(1024, model.num_heads, device="cuda")
    with _jit.count_compiles() as log:
        for _ in range(6):
            s_q = int(torch.randint(1, 1024, (1,), generator=g))
            s_k = int(torch.randint(1, 40000, (1,), generator=g))
            ks, ke = W.random_windows(s_q, s_k, generator=g, device="cuda")
            q = (q_full[0][:s_q], None if q_full[1] is None else q_full[1][:s_q])
            tilefuse.fp8_fp4_mqa_topk(q, (kv_full[0][:s_k], kv_full[1][:s_k]), w_full[:s_q], ks, ke, model.topk)
        for ctx_2d in (False, True):
            for _ in range(3):
                batch = int(torch.randint(1, 40, (1,), generator=g))
                max_len = int(torch.randint(1, 40000, (1,), generator=g))
                pages = -(-max_len // model.block_kv)
                cache = paged.new_paged_kv_cache(batch * pages, model.block_kv, model.head_dim, model.fmt,
                                                 device="cuda")
                table = torch.randperm(batch * pages, generator=g).int().view(batch, pages).cuda()
                shape = (batch, model.next_n) if ctx_2d else (batch,)
                lens = torch.randint(model.next_n, max_len + 1, shape, generator=g).int().cuda()
                (values, sf), _ = prefill._zero_inputs(model.fmt, batch * model.next_n, 1, model.num_heads,
                                                       model.head_dim, "cuda")
                q = (values.view(batch, model.next_n, *values.shape[1:]),
                     None if sf is None else sf.view(batch, model.next_n, model.num_heads))
                w = torch.randn(batch * model.next_n, model.num_heads, device="cuda")
                meta = paged.get_paged_mqa_logits_metadata(lens, model.block_kv, 132)
                topk_op.fp8_fp4_paged_mqa_topk(q, cache, w, lens, table, meta, max_len, model.topk)
        torch.cuda.synchronize()
    assert log.compiles == [], log.compiles
