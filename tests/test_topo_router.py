"""Topology-aware routing (--moe-router-topology): node_limited, congestion, ta_loss; cross-node telemetry.

The routers are built in-process with an explicit EPLayout (any E / EP / ranks-per-node combination
without spawning EP processes); the end-to-end runs train a tiny GPT-MoE on 2 gloo ranks, EP=2,
--ranks-per-node 1 (two emulated nodes).
"""

import dataclasses
import math
import re
import types

import pytest
import torch

from megatron_moe.moe import topo_router as tr
from megatron_moe.moe.telemetry import ExpertLoadTracker


class _Group:
    """A size-1 process group stand-in (the routers only ask tp/cp groups for their size)."""

    def size(self):
        return 1

    def rank(self):
        return 0


PG = types.SimpleNamespace(tp=_Group(), cp=_Group(), tp_cp=_Group(), tp_dp_cp=_Group(), ep=_Group())


def config(num_experts, topk, score_function="softmax", pre_softmax=False, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    pre_softmax = pre_softmax or (topk == 1 and score_function == "softmax")  # megatron-core's rule
    return TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=1,
                             num_moe_experts=num_experts, moe_router_topk=topk,
                             moe_router_score_function=score_function,
                             moe_router_pre_softmax=pre_softmax, use_cpu_initialization=True,
                             moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                             moe_router_dtype="fp32", **kw)


def plain_router(cfg):
    from megatron.core.transformer.moe.router import TopKRouter

    return TopKRouter(cfg, PG)


def random_logits(tokens, experts, seed=0, bias=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, 1, experts, generator=g) * 2.0
    if bias is not None:
        logits = logits + bias
    return logits


def assert_topk_semantics(probs, routing_map, logits, k, score_function, pre_softmax):
    """k distinct experts per token; probs of the chosen set as megatron-core's score function."""
    logits = logits.view(routing_map.shape)
    assert routing_map.dtype == torch.bool
    assert (routing_map.sum(dim=1) == k).all()
    assert ((probs != 0) == routing_map).all()
    chosen = torch.where(routing_map, logits, torch.full_like(logits, float("-inf")))
    if score_function == "sigmoid":
        s = torch.sigmoid(logits) * routing_map
        expected = s / s.sum(dim=1, keepdim=True) if k > 1 else s
    elif pre_softmax:
        expected = torch.softmax(logits, dim=1) * routing_map
    else:
        expected = torch.softmax(chosen, dim=1)
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-6)


def nodes_per_token(routing_map, layout):
    e = routing_map.shape[1]
    return routing_map.view(-1, layout.nodes, e // layout.nodes).any(-1).sum(-1)


@pytest.fixture(autouse=True)
def _clean_aux_tracker():
    from megatron_moe.compat.moe_metrics import drop_moe_metric  # tracker API per megatron-core

    drop_moe_metric("topology_loss")
    yield
    drop_moe_metric("topology_loss")


# --- node_limited ---------------------------------------------------------------------------------
# (experts, EP size, EP ranks per node, top-k, max nodes M)
NODE_LIMITED = [(8, 4, 1, 2, 1), (8, 4, 2, 3, 1), (16, 8, 2, 4, 2), (12, 6, 2, 3, 2),
                (16, 4, 1, 4, 3), (32, 8, 2, 6, 2)]


@pytest.mark.parametrize("score", [("softmax", False), ("softmax", True), ("sigmoid", False)],
                         ids=["softmax", "pre-softmax", "sigmoid"])
@pytest.mark.parametrize("E,ep,rpn,k,M", NODE_LIMITED)
def test_node_limited_spans_at_most_max_nodes(E, ep, rpn, k, M, score):
    score_function, pre_softmax = score
    cfg = config(E, k, score_function, pre_softmax)
    bound = 0
    for ep_rank in (0, ep - 1):
        layout = tr.EPLayout(ep_rank=ep_rank, ep_size=ep, ranks_per_node=rpn)
        router = tr.NodeLimitedRouter(cfg, PG, max_nodes=M, layout=layout)
        assert router.config is not cfg and cfg.moe_router_group_topk is None  # model config untouched
        logits = random_logits(256, E, seed=ep_rank)
        probs, routing_map = router.routing(logits)
        assert int(nodes_per_token(routing_map, layout).max()) <= M
        assert_topk_semantics(probs, routing_map, logits, k, score_function, pre_softmax)
        # the k experts are the best ones on the nodes the token uses
        lg = logits.view(-1, E)
        node_used = routing_map.view(-1, layout.nodes, E // layout.nodes).any(-1)
        allowed = node_used.repeat_interleave(E // layout.nodes, dim=1)
        best = torch.topk(lg.masked_fill(~allowed, float("-inf")), k, dim=1).indices
        assert (routing_map.gather(1, best)).all()
        # the limit binds: plain top-k spans more than M nodes for some tokens
        _, plain_map = plain_router(config(E, k, score_function, pre_softmax)).routing(logits)
        bound += int((nodes_per_token(plain_map, layout) > M).sum())
    assert bound > 0


def test_node_limited_validation_names_the_flag():
    layout = tr.EPLayout(ep_rank=0, ep_size=4, ranks_per_node=2)  # 2 nodes, 4 experts per node
    with pytest.raises(ValueError, match="--moe-router-max-nodes=3 must be in"):
        tr.NodeLimitedRouter(config(8, 2), PG, max_nodes=3, layout=layout)
    with pytest.raises(ValueError, match="--moe-router-max-nodes=1 x 4 experts per node"):
        tr.NodeLimitedRouter(config(8, 5), PG, max_nodes=1, layout=layout)
    with pytest.raises(ValueError, match="drop --moe-router-num-groups"):
        tr.NodeLimitedRouter(config(8, 2, moe_router_num_groups=2, moe_router_group_topk=1), PG,
                             max_nodes=1, layout=layout)


@pytest.mark.parametrize("layout,k,M", [
    (tr.EPLayout(ep_rank=1, ep_size=2, ranks_per_node=2), 2, 1),   # one node
    (tr.EPLayout(ep_rank=0, ep_size=4, ranks_per_node=1), 2, 2),   # k <= M: never binds
    (tr.EPLayout(ep_rank=0, ep_size=4, ranks_per_node=2), 3, 2),   # M = all nodes
])
def test_node_limited_degenerates_to_plain_topk(layout, k, M):
    logits = random_logits(128, 8)
    probs, routing_map = tr.NodeLimitedRouter(config(8, k), PG, max_nodes=M, layout=layout).routing(logits)
    ref_probs, ref_map = plain_router(config(8, k)).routing(logits)
    assert torch.equal(routing_map, ref_map) and torch.equal(probs, ref_probs)


# --- congestion -----------------------------------------------------------------------------------
# (experts, EP size, EP ranks per node, physical ranks per node, top-k)
CONGESTION = [(8, 4, 1, 1, 2), (8, 4, 2, 2, 2), (16, 8, 2, 2, 3), (12, 6, 3, 3, 1),
              (16, 8, 4, 4, 4), (8, 2, 1, 1, 4)]


def congestion_layout(ep_rank, ep, rpn, node_rpn):
    return tr.EPLayout(ep_rank=ep_rank, ep_size=ep, ranks_per_node=rpn, node_ranks_per_node=node_rpn,
                       intra_bandwidth_gbps=150.0, inter_bandwidth_gbps=50.0)


@pytest.mark.parametrize("score", [("softmax", False), ("sigmoid", False)], ids=["softmax", "sigmoid"])
@pytest.mark.parametrize("E,ep,rpn,node_rpn,k", CONGESTION)
def test_congestion_caps_the_leaving_fraction(E, ep, rpn, node_rpn, k, score):
    score_function, pre_softmax = score
    cfg = config(E, k, score_function, pre_softmax)
    pre_softmax = cfg.moe_router_pre_softmax
    for ep_rank in (0, ep - 1):
        layout = congestion_layout(ep_rank, ep, rpn, node_rpn)
        router = tr.CongestionRouter(cfg, PG, layout=layout)
        cap = 50.0 / (node_rpn * 150.0)  # FasterMoE: W_net / (M * W_local)
        assert router.cap == pytest.approx(cap)
        tokens = 200
        logits = random_logits(tokens, E, seed=ep_rank)
        probs, routing_map = router.routing(logits)
        off = layout.expert_nodes(E) != layout.my_node
        leaving = int(routing_map[:, off].sum())
        allowed = math.floor(cap * tokens * k)
        # floor: the cap holds exactly, no rounding allowance; binding here, so it is met exactly
        _, plain_map = plain_router(config(E, k, score_function, pre_softmax)).routing(logits)
        assert int(plain_map[:, off].sum()) > allowed
        assert leaving == allowed and leaving / (tokens * k) <= cap
        assert_topk_semantics(probs, routing_map, logits, k, score_function, pre_softmax)
        # the kept off-node assignments are the best-scoring off-node ones of plain top-k
        lg = logits.view(tokens, E)
        # ranked across tokens by gate probability (softmax over all experts) or sigmoid score
        prio = torch.softmax(lg, 1) if score_function == "softmax" else torch.sigmoid(lg)
        kept = prio[routing_map & off]
        dropped = prio[plain_map & ~routing_map & off]
        assert kept.min() >= dropped.max()
        assert not (routing_map & off & ~plain_map).any()  # nothing new goes off-node
        # deterministic
        again_probs, again_map = router.routing(logits)
        assert torch.equal(again_map, routing_map) and torch.equal(again_probs, probs)


@pytest.mark.parametrize("E,ep,rpn,node_rpn,k", CONGESTION)
def test_congestion_under_the_cap_is_plain_topk(E, ep, rpn, node_rpn, k):
    layout = congestion_layout(ep - 1, ep, rpn, node_rpn)
    router = tr.CongestionRouter(config(E, k), PG, layout=layout)
    off = layout.expert_nodes(E) != layout.my_node
    allowed = math.floor(router.cap * 200 * k)
    # favour local experts just enough that the off-node choices fit under the cap, but exist
    for bias in torch.arange(0.0, 10.0, 0.25):
        logits = random_logits(200, E, seed=3, bias=(~off).float() * bias)
        ref_probs, ref_map = plain_router(config(E, k)).routing(logits)
        if 0 < int(ref_map[:, off].sum()) <= allowed:
            break
    assert 0 < int(ref_map[:, off].sum()) <= allowed
    probs, routing_map = router.routing(logits)
    assert torch.equal(routing_map, ref_map) and torch.equal(probs, ref_probs)


def test_congestion_gradient_flows_through_the_chosen_scores():
    layout = congestion_layout(0, 4, 1, 1)
    router = tr.CongestionRouter(config(8, 2), PG, layout=layout)
    logits = random_logits(64, 8).requires_grad_()
    probs, routing_map = router.routing(logits)
    (probs * torch.arange(8.0)).sum().backward()
    grad = logits.grad.view(64, 8)
    assert (grad[~routing_map] == 0).all() and grad[routing_map].abs().sum() > 0


def test_congestion_validation():
    layout = congestion_layout(0, 4, 2, 2)  # 2 nodes, 4 experts per node
    with pytest.raises(ValueError, match="--moe-router-topk 5 exceeds the 4 experts per node"):
        tr.CongestionRouter(config(8, 5), PG, layout=layout)


# --- ta_loss --------------------------------------------------------------------------------------
def test_link_costs():
    layout = tr.EPLayout(ep_rank=1, ep_size=4, ranks_per_node=2, intra_bandwidth_gbps=200.0,
                         inter_bandwidth_gbps=50.0)
    # experts 0..7 on ranks 0,0,1,1,2,2,3,3; ranks 0,1 on node 0
    assert tr.link_costs(layout, 8).tolist() == [0.25, 0.25, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_ta_loss_pushes_probability_toward_local_experts(score_function):
    from megatron_moe.compat.moe_metrics import moe_metric_values

    E, k, coeff = 8, 2, 0.1
    layout = tr.EPLayout(ep_rank=1, ep_size=4, ranks_per_node=2)
    router = tr.TopologyLossRouter(config(E, k, score_function), PG, coeff=coeff, layout=layout)
    router.set_layer_number(2)
    logits = random_logits(64, E).requires_grad_()
    probs, routing_map = router.routing(logits)
    # routing is plain top-k
    ref_probs, ref_map = plain_router(config(E, k, score_function)).routing(logits.detach())
    assert torch.equal(routing_map, ref_map) and torch.equal(probs.detach(), ref_probs)
    # the logged value: expected link cost per token (coefficient divided out)
    cost = tr.link_costs(layout, E)
    lg = logits.detach().view(-1, E)
    scores = torch.softmax(lg, 1) if score_function == "softmax" else \
        torch.sigmoid(lg) / torch.sigmoid(lg).sum(1, keepdim=True)
    logged = moe_metric_values()["topology_loss"]
    assert logged[1].item() == pytest.approx(float((scores * cost).sum(1).mean()), rel=1e-5)
    assert logged[0].item() == 0.0
    # the gradient (upstream of probs zero: only the auxiliary loss) lowers the expected link cost
    (probs * 0).sum().backward()
    grad = logits.grad.view(-1, E).double()
    assert grad.abs().sum() > 0
    # a gradient-descent step lowers every token's expected link cost and moves probability mass
    # from remote to local experts (step in units of the per-token loss scale coeff / tokens)
    cost, lg, scores = cost.double(), lg.double(), scores.double()
    for step in (0.1, 1.0):
        new = lg - step * grad * 64 / coeff
        new_scores = torch.softmax(new, 1) if score_function == "softmax" else \
            torch.sigmoid(new) / torch.sigmoid(new).sum(1, keepdim=True)
        assert ((new_scores * cost).sum(1) < (scores * cost).sum(1)).all()
        assert new_scores[:, cost < 1].sum() > scores[:, cost < 1].sum()
    if score_function == "softmax":
        # d/dz_e = coeff/T * p_e * (c_e - expected cost): own-rank experts up, remote ones down
        assert (grad[:, cost == 0] < 0).all() and (grad[:, cost == 1] > 0).all()


@pytest.mark.parametrize("coeff,layout", [
    (0.0, tr.EPLayout(ep_rank=0, ep_size=2, ranks_per_node=1)),
    (0.5, tr.EPLayout(ep_rank=0, ep_size=2, ranks_per_node=2)),   # one node: plain top-k
], ids=["coeff0", "one-node"])
def test_ta_loss_coefficient_zero_costs_nothing(coeff, layout):
    from megatron_moe.compat.moe_metrics import moe_metric_values

    router = tr.TopologyLossRouter(config(4, 2), PG, coeff=coeff, layout=layout)
    router.set_layer_number(1)
    logits = random_logits(32, 4).requires_grad_()
    probs, routing_map = router.routing(logits)
    (probs * 0).sum().backward()
    assert logits.grad is None or (logits.grad == 0).all()
    assert "topology_loss" not in moe_metric_values()
    ref_probs, ref_map = plain_router(config(4, 2)).routing(logits.detach())
    assert torch.equal(routing_map, ref_map) and torch.equal(probs.detach(), ref_probs)


# --- spec hook, telemetry, log parsing ------------------------------------------------------------
def test_customize_spec_swaps_the_router():
    import functools

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.router import TopKRouter

    def args(mode):
        return types.SimpleNamespace(num_experts=4, moe_router_topology=mode, moe_router_max_nodes=1,
                                     moe_topology_loss_coeff=0.5)

    from megatron_moe.compat import replace_spec, spec_submodules  # ModuleSpec or partial (0.18+)

    def router(spec):
        return spec_submodules(spec.submodules.mlp).router

    spec = get_gpt_layer_local_spec(num_experts=4)
    assert router(tr.customize_spec(args("none"), spec)) is TopKRouter
    for mode, cls in tr.ROUTERS.items():
        spec = tr.customize_spec(args(mode), get_gpt_layer_local_spec(num_experts=4))
        builder = router(spec)
        assert isinstance(builder, functools.partial) and builder.func is cls
    assert router(spec).keywords == {"coeff": 0.5}
    mlp = spec.submodules.mlp
    other = type("Other", (TopKRouter,), {})
    spec.submodules.mlp = replace_spec(mlp, submodules=dataclasses.replace(spec_submodules(mlp), router=other))
    with pytest.raises(ValueError, match="already customised"):
        tr.customize_spec(args("congestion"), spec)


def test_tracker_reports_cross_node_fraction():
    layout = tr.EPLayout(ep_rank=2, ep_size=4, ranks_per_node=2)  # node 1 holds experts 4..7
    tracker = ExpertLoadTracker(num_layers=2, num_experts=8, ep_size=4, layout=layout)
    tracker.attach([])
    router = types.SimpleNamespace(layer_number=2)
    routing_map = torch.zeros(4, 8, dtype=torch.bool)
    routing_map[0, [0, 5]] = True   # one off-node
    routing_map[1, [4, 6]] = True   # none
    routing_map[2, [1, 2]] = True   # two
    routing_map[3, [7, 3]] = True   # one
    tracker._hook(router, None, (None, routing_map))
    (load,) = tracker.collect()
    assert load.layer == 2 and load.cross_node_fraction == pytest.approx(4 / 8)
    one_node = ExpertLoadTracker(2, 8, 4, layout=tr.EPLayout(ep_rank=0, ep_size=4, ranks_per_node=4))
    one_node.attach([])
    one_node._hook(router, None, (None, routing_map))
    assert one_node.collect()[0].cross_node_fraction is None


def test_plot_tool_parses_lines_with_cross_node():
    from tools.plot_expert_load import parse_log

    lines = [" [2026-01-01 00:00:00.0] iteration        3/      10 | consumed samples: 24 |",
             " [moe] layer   1 | expert load max/mean: 1.164 | EP-rank load max/mean: 1.100 | "
             "tokens per expert: [107, 107, 149, 149] | cross-node 0.54 |",
             " [moe] layer   2 | expert load max/mean: 1.200 | EP-rank load max/mean: 1.050 | "
             "cross-node 0.25 |"]
    parsed = parse_log(lines)
    assert parsed[1] == [(3, 1.164, 1.1, [107, 107, 149, 149])]
    assert parsed[2] == [(3, 1.2, 1.05, None)]


# --- end to end: tiny GPT-MoE, 2 ranks, EP=2, one rank per node -----------------------------------
TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 --moe-router-topk 2 "
        "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 --log-interval 1 "
        "--eval-interval 1000 --eval-iters 1 --disable-bias-linear --train-iters 2 "
        "--expert-model-parallel-size 2 --ranks-per-node 1").split()
_CROSS = re.compile(r"^ \[moe\] layer +(\d+) \| expert load max/mean: [\d.]+ \| EP-rank load "
                    r"max/mean: [\d.]+ \| tokens per expert: \[[\d, ]*\] \| cross-node (\d\.\d\d) \|$")


@pytest.mark.parametrize("mode,extra", [("node_limited", "--moe-router-max-nodes 1"),
                                        ("congestion", ""),
                                        ("ta_loss", "--moe-topology-loss-coeff 0.1")])
def test_training_logs_cross_node_fraction(mode, extra):
    from megatron_moe.runtime.local_ranks import run_distributed
    from tests._topo_router_cases import run_pretrain_topology

    # no evaluation: the hooks below count every router call, the log line the training ones
    argv = TINY + f"--moe-router-topology {mode} {extra} --eval-iters 0".split()
    ranks = run_distributed(run_pretrain_topology, 2, argv, timeout_s=240)
    out = ranks[-1]["stdout"]
    fractions = [float(m.group(2)) for m in map(_CROSS.match, out.splitlines()) if m]
    assert len(fractions) == 2 * 2, out[-2000:]  # 2 MoE layers x 2 iterations
    assert all(r["calls"] == 2 * 2 * 2 for r in ranks)  # layers x iterations x micro-batches
    # the log's figure is the hooks' count over both ranks (each line rounds to 2 decimals)
    measured = sum(r["off_node"] for r in ranks) / sum(r["assignments"] for r in ranks)
    assert sum(fractions) / len(fractions) == pytest.approx(measured, abs=0.006)
    assert all(h == ranks[0]["history"] for h in (r["history"] for r in ranks))
    if mode == "node_limited":
        # M=1: every token's 2 experts sit on one node (not necessarily its own)
        assert all(r["max_nodes_per_token"] == 1 for r in ranks)
        assert 0 < measured < 1
    elif mode == "congestion":
        # cap = 25/(1*150) GB/s ratio; 2 x 32 tokens x 2 per micro-batch: floor(cap*128) = 21
        cap = 25.0 / 150.0
        assert all(r["off_node"] <= math.floor(cap * 128) * 8 for r in ranks)
        assert max(fractions) <= round(cap, 2)
    else:
        assert "topology_loss:" in out
        assert all(r["max_nodes_per_token"] == 2 for r in ranks)  # routing is unconstrained
