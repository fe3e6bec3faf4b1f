"""megatron_moe.comm: all-to-all algorithms, compression, chunked scheduling (issue 4)."""

import math
import random

import pytest
import torch

from megatron_moe.comm import schedule
from megatron_moe.comm.alltoall import formula_wire_stats, wire_stats
from megatron_moe.comm.compress import (Compressor, available_compressions, get_compression,
                                        register_compression)
from megatron_moe.runtime.local_ranks import run_distributed
from tests import _comm_cases

# ---------------------------------------------------------------------------------------------
# multi-rank: bit-exactness for every algorithm on emulated topologies 2x2, 2x3, 3x2, 4x1


def _check_world(out, rpns):
    for rank, res in enumerate(out):
        for rpn in rpns:
            for key, val in res[f"exact/{rpn}"].items():
                if key.startswith("bytes/"):
                    assert val[0], (rank, rpn, key, val[1], val[2])
                else:
                    assert val is True, (rank, rpn, key)
            for key, (fwd_ok, bwd_ok) in res[f"compress/{rpn}"].items():
                assert fwd_ok and bwd_ok, (rank, rpn, key)
            for key, err in res[f"chunked/{rpn}"].items():
                assert err < 1e-12, (rank, rpn, key, err)
        for tag in ("subgroup", "strided"):
            for key, val in res[tag].items():
                ok = val[0] if key.startswith("bytes/") else val
                assert ok is True, (rank, tag, key, val)


def test_world4_topologies_2x2_and_4x1():
    # 4 ranks: 2 ranks/node = 2 nodes x 2; 1 rank/node = 4 nodes x 1; 4 ranks/node = 1 x 4
    out = run_distributed(_comm_cases.world_cases, 4, [2, 1, 4], timeout_s=420)
    _check_world(out, [2, 1, 4])


def test_world6_topologies_2x3_and_3x2():
    # 6 ranks: 3 ranks/node = 2 nodes x 3; 2 ranks/node = 3 nodes x 2
    out = run_distributed(_comm_cases.world_cases, 6, [3, 2], timeout_s=480)
    _check_world(out, [3, 2])


# ---------------------------------------------------------------------------------------------
# byte accounting against the note's formulas (schemoe.md 5.3), uniform all-to-all


@pytest.mark.parametrize("P,M", [(4, 2), (6, 3), (6, 2), (4, 1), (8, 4)])
@pytest.mark.parametrize("algo", ["flat", "pipe", "hierarchical"])
def test_wire_stats_match_formulas(P, M, algo):
    rows_per_peer, row_bytes = 3, 16
    S = [[rows_per_peer] * P for _ in range(P)]
    S_bytes = P * rows_per_peer * row_bytes  # bytes each rank sends in total (incl. to itself)
    want = formula_wire_stats(algo, S_bytes, P, M)
    for rank in range(P):
        got = wire_stats(algo, S, row_bytes, M, rank=rank)
        for k, v in want.items():
            assert got[k] == pytest.approx(v), (rank, k)


def test_hierarchical_sends_fewer_inter_node_messages():
    P, M = 8, 4
    S = [[1] * P for _ in range(P)]
    flat = wire_stats("flat", S, 8, M)
    hier = wire_stats("hierarchical", S, 8, M)
    # same inter-node bytes, N-1 instead of P-M messages per rank
    assert hier["inter_bytes"] == flat["inter_bytes"]
    assert hier["inter_msgs"] == P * (P // M - 1) < flat["inter_msgs"] == P * (P - M)


# ---------------------------------------------------------------------------------------------
# compression error bounds (documented in megatron_moe/comm/compress.py)


def _sample(rows=64, cols=33, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[0] = 7.25  # a constant row
    return x


def test_none_is_exact_and_other_dtypes_pass_through():
    c = get_compression("none")
    x = _sample()
    assert torch.equal(c.decompress(c.compress(x), x.dtype, x.shape[1]), x)
    # integer tensors and 1-D tensors are never compressed
    for name in available_compressions():
        comp = get_compression(name)
        assert not comp.applies_to(torch.arange(6).reshape(3, 2))
        assert not comp.applies_to(torch.randn(5))


def test_fp16_bound():
    x = _sample()
    c = get_compression("fp16")
    y = c.decompress(c.compress(x), x.dtype, x.shape[1])
    normal = x.abs() >= 2 ** -14
    assert ((y - x).abs()[normal] <= 2 ** -11 * x.abs()[normal]).all()
    assert ((y - x).abs()[~normal] <= 2 ** -25).all()
    assert c.wire_bytes_per_row(33, torch.float32) == 66
    assert not c.applies_to(torch.randn(3, 4, dtype=torch.bfloat16))  # no gain: same width


def test_bf16_bound():
    x = _sample()
    c = get_compression("bf16")
    y = c.decompress(c.compress(x), x.dtype, x.shape[1])
    assert ((y - x).abs() <= 2 ** -8 * x.abs()).all()


def test_int8_bound_and_wire_size():
    x = _sample()
    c = get_compression("int8")
    w = c.compress(x)
    assert w.dtype == torch.uint8 and w.shape == (x.shape[0], x.shape[1] + 8)
    y = c.decompress(w, x.dtype, x.shape[1])
    lo = x.amin(1, keepdim=True)
    s = x.amax(1, keepdim=True) - lo
    ulp = 2 * torch.finfo(torch.float32).eps * x.abs().amax(1, keepdim=True)
    err = x - y
    assert (err >= -ulp).all()
    assert (err <= s / 255 + ulp).all()
    assert torch.equal(y[0], x[0])  # constant row exact
    assert c.wire_bytes_per_row(33, torch.float32) == 41
    # bytes on the wire vs fp32 for a wide row: ~4x smaller
    assert c.wire_bytes_per_row(4096, torch.float32) / (4 * 4096) < 0.26
    # empty input
    assert c.compress(torch.empty(0, 5)).shape == (0, 13)


def test_register_user_compression():
    class Half(Compressor):
        name = "half_test"

        def compress(self, x):
            return x.half()

        def wire_bytes_per_row(self, cols, dtype):
            return 2 * cols

    register_compression("half_test", Half)
    assert "half_test" in available_compressions()
    assert get_compression("half_test").compress(torch.ones(2, 2)).dtype == torch.float16
    with pytest.raises(ValueError, match="--moe-a2a-compression='nope'"):
        get_compression("nope")
    with pytest.raises(TypeError, match="lacks method"):
        register_compression("bad", object())


def test_unknown_algorithm_names_the_flag():
    from megatron_moe.comm import get_algorithm

    with pytest.raises(ValueError, match="--moe-a2a-algorithm='ring2'"):
        get_algorithm("ring2")


# ---------------------------------------------------------------------------------------------
# OptSche: the note's worked example and optimality by brute force


WORKED = {"C": 1.0, "A": 4.0, "D": 1.0, "E": 3.0}


def test_worked_example_timeline():
    comp, comm_order = schedule.optsche_order(2)
    makespan, start = schedule.simulate(comp, comm_order, WORKED)
    assert makespan == 20
    want = {("C1", 0): 0, ("C1", 1): 1, ("D1", 0): 5, ("E", 0): 6, ("C2", 0): 9, ("D1", 1): 10,
            ("E", 1): 11, ("C2", 1): 14, ("D2", 0): 15, ("D2", 1): 19,
            ("A1", 0): 1, ("A1", 1): 5, ("A2", 0): 10, ("A2", 1): 15}
    assert {k: start[k] for k in want} == want
    assert schedule.simulate(*schedule.stage_major_order(2), WORKED)[0] == 26
    assert schedule.simulate_sequential(2, WORKED) == 30


def test_optsche_optimal_r2_exhaustive():
    rng = random.Random(0)
    assert len(schedule.valid_compute_orders(2)) == 252
    assert len(list(schedule.valid_comm_orders(2))) == 6
    for _ in range(25):
        d = {k: rng.uniform(0.1, 5.0) for k in "CADE"}
        opt = schedule.simulate(*schedule.optsche_order(2), d)[0]
        best, _ = schedule.brute_force_best(2, d, all_comm_orders=True)
        assert opt <= best + 1e-9, (d, opt, best)
        assert opt <= schedule.simulate_sequential(2, d) + 1e-9


def test_optsche_optimal_r3_pruned_search():
    rng = random.Random(1)
    for _ in range(4):
        d = {k: rng.uniform(0.1, 5.0) for k in "CADE"}
        opt = schedule.simulate(*schedule.optsche_order(3), d)[0]
        # exact search for a strictly shorter schedule (FIFO communication, as Eqs. 13-14)
        best, order = schedule.brute_force_best(3, d, all_comm_orders=False, bound=opt)
        assert order is None and best == pytest.approx(opt), (d, opt, best, order)
        assert opt <= schedule.simulate(*schedule.stage_major_order(3), d)[0] + 1e-9


def test_brute_force_finds_better_than_a_bad_order():
    # the search must be able to beat a deliberately poor bound (guards against a no-op search)
    d = dict(WORKED)
    best, order = schedule.brute_force_best(2, d, all_comm_orders=False, bound=26.0)
    assert order is not None and best == pytest.approx(20.0)
    assert math.isclose(schedule.simulate(*schedule.stage_major_order(2), d)[0], 26.0)


# ---------------------------------------------------------------------------------------------
# user extension points


def test_user_algorithm_and_nameless_compressor_on_two_ranks():
    for res in run_distributed(_comm_cases.user_plugins, 2, 1, timeout_s=120):
        assert res["exact"]
        # the user algorithm's record_wire_bytes calls reach count_wire_bytes
        assert res["counted"] == res["expected"] and res["counted"]["inter_bytes"] > 0
        # a subclass without its own name is registered under, and used as, the given name
        assert res["name"] == "user_half_test"
        assert res["compressed_as_fp16"] and res["lossy"]


def test_registered_algorithm_is_accepted_on_the_command_line():
    from megatron_moe import comm

    _comm_cases.register_user_plugins()

    class Args:
        moe_a2a_algorithm = "user_seq_test"
        moe_a2a_compression = "user_half_test"

    comm.validate_args(Args())
    parser = comm.add_arguments(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--moe-a2a-algorithm", "user_seq_test"])
    assert args.moe_a2a_algorithm == "user_seq_test"
    Args.moe_a2a_algorithm = "nope"
    with pytest.raises(ValueError, match="--moe-a2a-algorithm='nope'"):
        comm.validate_args(Args())


def test_int8_non_finite_row_decodes_to_nan():
    c = get_compression("int8")
    x = torch.tensor([[1.0, float("inf"), 2.0], [1.0, 2.0, 3.0]])
    y = c.decompress(c.compress(x), x.dtype, 3)
    assert torch.isnan(y[0]).all()  # loud, not silently clipped
    assert torch.isfinite(y[1]).all()


def test_router_topology_flag_checks_at_parse_time():
    """Checks that need only flags run in validate_args, before any process group exists."""
    import argparse

    from megatron_moe import comm

    def args(*argv):
        a = comm.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))
        a.num_experts, a.moe_router_num_groups, a.moe_router_group_topk = 4, None, None
        a.moe_router_fusion = False
        return a

    comm.validate_args(args("--moe-router-topology", "node_limited"))   # valid: no error
    a = args("--moe-router-topology", "node_limited")
    a.moe_router_num_groups = 2
    with pytest.raises(ValueError, match="drop --moe-router-num-groups"):
        comm.validate_args(a)
    a = args("--moe-router-topology", "congestion")
    a.moe_router_fusion = True
    with pytest.raises(ValueError, match="drop --moe-router-fusion"):
        comm.validate_args(a)
    with pytest.raises(ValueError, match="--moe-topology-loss-coeff=-1.0"):
        comm.validate_args(args("--moe-router-topology", "ta_loss", "--moe-topology-loss-coeff", "-1"))
    a = args("--moe-router-topology", "ta_loss")
    a.num_experts = None
    with pytest.raises(ValueError, match="set --num-experts"):
        comm.validate_args(a)
