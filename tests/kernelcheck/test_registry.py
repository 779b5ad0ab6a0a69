"""The registry (built by tracing the launch sites) and the prefill dispatch table."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tilefuse._config import apply_override, config_override
from tilefuse.formats import FORMAT_CODE
from tilefuse.indexer import _dispatch, prefill
from tilefuse.kernelcheck import variants as V


@pytest.fixture(scope="module")
def registry():
    return V.variants()


def test_names_unique_and_compiles_distinct(registry):
    for kernel in {v.kernel for v in registry}:
        vs = [v for v in registry if v.kernel == kernel]
        assert len({v.name for v in vs}) == len(vs)
        assert len({v.compile_key() for v in vs}) == len(vs)


def test_round_trip_through_json(registry):
    import json

    for v in registry:
        assert V.Variant.from_dict(json.loads(json.dumps(v.to_dict()))) == v


def test_prefill_defaults_are_covered(registry):
    """Every tile default_config picks appears, in every format, D and output layout."""
    pre = [v for v in registry if v.kernel == "indexer.prefill" and v.origin == "default"]
    few_rows = [v for v in pre if v.function.endswith(":prefill_heads_on_n_kernel")]
    pre = [v for v in pre if v.function.endswith(":prefill_logits_kernel")]
    for fmt, d in V._FMT_D:
        code = FORMAT_CODE[fmt]
        mine = [v for v in pre if v.constexprs["FMT"] == code and v.constexprs["D"] == d]
        for s_q in V._Q_ROWS:
            cfg = prefill.default_config(fmt, 64, d, s_q)
            # FP8's few-row default is the heads_on_n kernel; MX's keeps the tile for its recompute
            few = cfg.heads_on_n and fmt == "fp8"
            kernels = [v for v in few_rows if v.name.startswith(f"{fmt} D{d} ")] if few else mine
            tiles = {(v.constexprs["BLOCK_Q"], v.constexprs["BLOCK_N"], v.num_warps, v.num_stages) for v in kernels}
            assert (cfg.block_q, cfg.block_n, cfg.num_warps, cfg.num_stages) in tiles, (fmt, d, s_q, cfg)
        layouts = {(v.constexprs["CLEAN"], v.constexprs["COMPRESSED"]) for v in mine}
        assert layouts == set(V._LAYOUTS)


def test_prefill_variants_follow_the_launch(registry):
    v = next(v for v in registry if v.kernel == "indexer.prefill" and v.name.startswith("mxfp4 D128 H64 full+clean"))
    dq = 64
    assert v.signature["q_desc"].startswith("tensordesc<i8[") and v.signature["q_desc"].endswith(f", {dq}]>")
    assert v.signature["k_scale_ptr"] == "*i32" and v.signature["out_ptr"] == "*fp32"
    # Sizes and strides are runtime values (no compile per shape), however divisible they are.
    assert not {"S_q", "S_k", "stride_out", "stride_w"} & set(v.aligned)


def test_targets_follow_the_dispatch_table(registry):
    for v in registry:
        if v.kernel == "indexer.prefill":
            # The op's format, not the launch's FMT: MXFP4's FP8 pass runs FMT = fp8 on Hopper only.
            mx = not v.name.startswith("fp8 ")
            assert v.targets == (("sm_90a",) if mx else ("sm_90a", "sm_100a")), v.name
        elif v.kernel == "indexer.prefill_sm100":
            assert v.targets == ("sm_100a",)
        elif v.kernel in ("indexer.prefill_gluon", "indexer.paged_gluon", "indexer.paged_persistent", "tp.rs_gluon"):
            assert v.targets == ("sm_90a",)
        elif v.kernel == "indexer.topk_merge":
            assert v.targets in (V.TARGETS_ALL, ("sm_90a",)), v.name
        else:
            assert v.targets == V.TARGETS_ALL
    # The top-k merge's sm_100a subset: every chunk position, values from both logits dtypes and
    # the last step after each kind of pass (at its default warps).
    blackwell = [v.name for v in registry if v.kernel == "indexer.topk_merge" and "sm_100a" in v.targets]
    for part in (" first ", " middle ", " last ", " only ", "logits=bf16 values", "after-passes w16 maxima"):
        assert any(part in n + " " for n in blackwell), part
    assert any(n.endswith("after-passes w8") for n in blackwell)


def test_tp_variants_use_the_gpu_timer(registry):
    for v in registry:
        if v.kernel.startswith("tp.") and "USE_TIMER" in v.constexprs:
            assert v.constexprs["USE_TIMER"] is True


def test_every_prefill_option_is_varied():
    base = prefill.default_config("fp8", 64, 128)
    flipped = {f.name for cfg in V.prefill_option_configs(base) for f in dataclasses.fields(cfg)
               if getattr(cfg, f.name) != getattr(base, f.name)}
    options = {f.name for f in dataclasses.fields(base)} - set(V._TILE_FIELDS) - set(V._GLUON_ONLY_FIELDS)
    assert flipped == options
    # Gluon-only fields are varied by the Gluon kernel's own registry.
    names = [v.name for v in V.prefill_gluon_variants()]
    assert any(n.endswith("refill2") for n in names) and any("w4 buf4" in n and "refill" not in n for n in names)


def test_unknown_config_field_is_an_error():
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        block_q: int = 64
        new_knob: int = 3

    with pytest.raises(ValueError, match="new_knob"):
        V.prefill_option_configs(Cfg())


def test_bad_selection():
    with pytest.raises(ValueError, match="kernel"):
        V.variants("no.such.kernel")
    with pytest.raises(ValueError, match="target"):
        V.variants(target="sm_80")


def test_tracing_restores_kernels_and_config_overrides():
    kernel = prefill.kern.prefill_logits_kernel
    with config_override("prefill", block_n=64):
        with V.tracing(f"{prefill.kern.__name__}:prefill_logits_kernel"):
            assert apply_override(prefill.PrefillConfig(), "prefill") == prefill.PrefillConfig()
            assert prefill.kern.prefill_logits_kernel is not kernel
        assert prefill.kern.prefill_logits_kernel is kernel
        assert apply_override(prefill.PrefillConfig(), "prefill").block_n == 64


# ---------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("major,fmt,path", [
    (9, "fp8", "hopper-fp8"),
    (9, "mxfp8", "hopper-mx-bf16"),
    (9, "mxfp4", "hopper-mx-bf16"),
    (10, "fp8", "hopper-fp8"),
    (10, "mxfp8", "sm100-mx-dot-scaled"),
    (10, "mxfp4", "sm100-mx-dot-scaled"),
    (None, "mxfp8", "hopper-mx-bf16"),  # CPU: the interpreter runs the Hopper kernel
    (8, "mxfp4", "hopper-mx-bf16"),
    (12, "mxfp8", "hopper-mx-bf16"),  # consumer Blackwell: no tcgen05
])
def test_dispatch_table(major, fmt, path):
    assert _dispatch.prefill_kernel_path(major, fmt) == path
    assert path in _dispatch.KERNEL_OF_PATH


def test_dispatch_rejects_unknown_format():
    with pytest.raises(ValueError, match="fmt"):
        _dispatch.prefill_kernel_path(9, "int8")


def test_capability_of_cpu_is_none():
    assert _dispatch.capability_major(torch.device("cpu")) is None
    assert _dispatch.capability_major("cpu") is None
    assert _dispatch.capability_major(None) is None
