"""The NCCL + GEMM path (what the policy picks off-node, for tiny shapes, or without CUDA) under
real process groups: gloo with 2, 4 and 8 CPU processes; the product runs on the tilefuse GEMM
kernel through the interpreter. Also the argument checks that need a group."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from tilefuse._interpreter import patch_interpreter_numerics

    patch_interpreter_numerics()
    import torch.distributed as dist

    import tilefuse.tp as td
    from tilefuse.reference.comm_gemm import ag_gemm_ref, gemm_rs_ref

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = td.GemmConfig(16, 16, 16, 2, 1, 4)
        g = torch.Generator().manual_seed(rank)
        mc, k, n = 12, 32, 24

        def close(x, ref):
            err = float((x.float() - ref.float()).norm() / ref.float().norm())
            assert not x.isnan().any() and err < 1e-2, f"rank {rank}: relative error {err}"

        a = torch.randn(mc, k, generator=g).to(torch.bfloat16)
        b = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
        out = torch.full((mc * world, n), float("nan")).to(torch.bfloat16)
        y, gathered = td.ag_gemm(a, b, out=out, b_layout="nk", return_gathered=True,
                                 options=td.AgGemmOptions(config=cfg))
        assert y is out
        close(y, ag_gemm_ref(a, b, b_layout="nk"))
        assert torch.equal(gathered[rank * mc : (rank + 1) * mc], a)

        a = torch.randn(mc * world, k, generator=g).to(torch.bfloat16)
        b = (torch.randn(k, n, generator=g) / k**0.5).to(torch.bfloat16)
        with td.use_options(td.GemmRsOptions(config=cfg)):
            close(td.gemm_rs(a, b), gemm_rs_ref(a, b))

        dec = td.decide("gemm_rs", mc * world, n, k, world, torch.bfloat16, device_type="cpu")
        assert dec.path == "nccl"
        try:
            td.gemm_rs(a[: mc * world - 1], b)
            raise AssertionError("M not divisible by W accepted")
        except ValueError as e:
            assert "divisible by the world size" in str(e)
        try:
            td.ag_gemm(a[:mc], b, out=torch.empty(mc, n, dtype=torch.bfloat16))
            raise AssertionError("wrong out shape accepted")
        except ValueError as e:
            assert "out must be" in str(e)
        try:
            td.ag_gemm(a[:mc], b, path="fused")
            raise AssertionError("fused path on CPU accepted")
        except ValueError as e:
            assert "forced but is unavailable" in str(e)
        _shape_checks(td, dist, rank, world, mc, k, n)
        if world == 2:
            _compiled_tp_layer(td, dist, rank, world)
        from tilefuse.tp.trace import clock_offsets

        assert clock_offsets() == [0] * world  # no GPU timers to line up
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _expect_value_error(fn, *words):
    try:
        fn()
    except ValueError as e:
        assert all(w in str(e) for w in words), str(e)
        return
    raise AssertionError(f"no ValueError mentioning {words}")


def _shape_checks(td, dist, rank, world, mc, k, n):
    """Shapes that differ between ranks raise on every rank, naming the argument and each rank's
    shape, before any collective of the op; one shape-agreement collective per new shape key,
    none for a shape seen before; 0-row shards raise by name."""
    # (Shapes no rank has passed before: a rank repeating a checked shape does not check again.)
    b = torch.randn(k, n).to(torch.bfloat16)
    rows = [mc + 1 + (r == world - 1) for r in range(world)]  # the last rank has one row more
    sizes = ", ".join(f"rank {r} ({rows[r]}, {k})" for r in range(world))
    _expect_value_error(lambda: td.ag_gemm(torch.randn(rows[rank], k).to(torch.bfloat16), b), "a_shard", sizes)
    a = torch.randn(rows[rank] * world, k).to(torch.bfloat16)
    rs_sizes = ", ".join(f"rank {r} ({rows[r] * world}, {k})" for r in range(world))
    _expect_value_error(lambda: td.gemm_rs(a, b), "tilefuse.tp.gemm_rs: a must have the same shape", rs_sizes)
    bw = torch.randn(k, n + 8 * rank).to(torch.bfloat16)  # weights of another width on every rank
    _expect_value_error(lambda: td.ag_gemm(torch.randn(mc + 7, k).to(torch.bfloat16), bw), "b must have the same")
    _expect_value_error(lambda: td.ag_gemm(torch.empty(0, k, dtype=torch.bfloat16), b), "a_shard has 0 rows")
    _expect_value_error(lambda: td.gemm_rs(torch.empty(0, k, dtype=torch.bfloat16), b), "a has 0 rows")

    calls = []
    real = dist.all_gather_object

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_gather_object = counting
    try:
        x = torch.randn(mc + 3, k).to(torch.bfloat16)
        cfg = td.AgGemmOptions(config=td.GemmConfig(16, 16, 16, 2, 1, 4))
        first = td.ag_gemm(x, b, options=cfg)
        assert len(calls) == 1, calls
        again = td.ag_gemm(x, b, options=cfg)
        assert len(calls) == 1, "a shape checked before cost another collective"
        assert torch.equal(first, again)
    finally:
        dist.all_gather_object = real


def _compiled_tp_layer(td, dist, rank, world):
    """A column-parallel + row-parallel pair under torch.compile(fullgraph=True): one graph,
    both custom ops in it, the result equal to the eager ops'."""
    import torch._dynamo.testing

    cfg = td.GemmConfig(16, 16, 16, 2, 1, 4)
    group_name = dist.group.WORLD.group_name
    mc, k, hidden, n = 8, 32, 16, 24
    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(mc, k, generator=g).to(torch.bfloat16)
    w_up = (torch.randn(hidden, k, generator=g) / k**0.5).to(torch.bfloat16)  # nn.Linear [N, K]
    w_down = (torch.randn(hidden, n, generator=g) / hidden**0.5).to(torch.bfloat16)

    def layer(x, w_up, w_down):
        h = torch.ops.tilefuse.ag_gemm(x, w_up, group_name, "nk")
        return torch.ops.tilefuse.gemm_rs(torch.relu(h), w_down, group_name, "kn")

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    with td.use_options(td.AgGemmOptions(config=cfg), td.GemmRsOptions(config=cfg)):
        y = torch.compile(layer, backend=counter, fullgraph=True)(x, w_up, w_down)
        eager = td.gemm_rs(torch.relu(td.ag_gemm(x, w_up, b_layout="nk")), w_down)
    assert counter.frame_count == 1 and y.shape == (mc, n)
    targets = {str(node.target) for gm in counter.graphs for node in gm.graph.nodes}
    assert {"tilefuse.ag_gemm", "tilefuse.gemm_rs"} <= targets, targets
    assert torch.equal(y, eager)


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [2, 4, 8])
def test_nccl_path_with_gloo_processes(world):
    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)


def test_needs_a_process_group(on_device):
    import tilefuse.tp as td

    a = torch.randn(8, 16).to(torch.bfloat16)
    b = torch.randn(16, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        td.ag_gemm(a, b)
