"""--moe-expert-offload host|ssd in the real pretrain() loop (2 gloo ranks, EP=2, 4 MoE layers,
K=2 device slots, NaN fill on, and a host resume and an ssd run without it, the default
zero-element placeholders): losses and grad norms bit-identical to resident training, across
resumes in every direction (resident -> host, host -> ssd, ssd -> resident) and with K = every
layer, each left bound until the optimizer step; the [offload] line's device peak, read from the arena's storage, is K/L of the resident
weights' storage (and K = L breaks the K = 2 bound); leaving out one forward bind, one copy wait,
one backward re-bind or one host-cache write-back (monkeypatched out) breaks the run, so
the equality is not luck. CUDA's drop of a parameter's grad-accumulator node on a change of
device (which cost DDP's grad hook on the GPU) is emulated on the CPU, with and without the
manager's renewal of DDP's hooks. Plus parse-time refusals and the SSD host cache (LFU vs LRU,
write-back)."""

import re

import pytest
import torch

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _offload_cases as C

_LINE = re.compile(r"\[offload\] device expert bytes peak: (\d+) of (\d+) \| host: (\d+) \| "
                   r"ssd: (\d+) \| prefetch hidden: (\d+)% \| ssd MB/step: ([\d.]+)$")


def _argv(iters, *extra):
    return ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 1 "
            "--weight-decay 0.1 --clip-grad 0.05 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 256 --num-experts 4 --moe-router-topk 2 "
            "--moe-token-dispatcher-type alltoall --log-interval 1 --eval-interval 1000 "
            "--eval-iters 1 --disable-bias-linear --expert-model-parallel-size 2 "
            f"--train-iters {iters}").split() + list(extra)


def _off(mode, tmp_path, *extra, nan_fill=True):
    out = ["--moe-expert-offload", mode, "--moe-offload-cache-layers", "2", *extra]
    if nan_fill:
        out.append("--moe-offload-debug-nan-fill")
    if mode == "ssd":  # a host cache smaller than the expert states: evictions and write-backs
        out += ["--moe-offload-dir", str(tmp_path / "ssd"), "--moe-offload-host-cache-gb", "0.0002"]
    return out


def _nan_stop(run):
    """The run stopped on a NaN (the loop's NaN-loss check exits 1; Megatron's result validation,
    the default --rerun-mode, 16 or 17 after re-running the iteration) or logged one."""
    return run.get("exit") in (1, 16, 17) or \
        any(x != x for x in run.get("history", {}).get("lm_loss", []))


def test_offload_bit_identical_over_resumes_and_each_mutation_fails(tmp_path):
    d = {k: str(tmp_path / k) for k in ("res", "host", "ssd")}
    host, ssd = _off("host", tmp_path), _off("ssd", tmp_path)
    runs = [
        _argv(4, "--save", d["res"], "--exit-interval", "2"),                      # 0 resident 1-2
        _argv(4, "--load", d["res"]),                                              # 1 resident 3-4
        _argv(4, *host, "--save", d["host"], "--exit-interval", "2"),              # 2 host 1-2
        _argv(4, *ssd, "--load", d["host"], "--save", d["ssd"], "--exit-interval", "3"),  # 3 host->ssd
        _argv(4, "--load", d["ssd"]),                                              # 4 ssd->resident 4
        # 5: the default path (no NaN fill: zero-element placeholders between uses)
        _argv(4, *_off("host", tmp_path, nan_fill=False), "--load", d["res"]),     # 5 resident->host 3-4
        # 6: K >= layers, every layer left bound from its backward until the step (skip_unbind):
        # the step updates the host copy, not the slot it would lose
        _argv(4, *_off("host", tmp_path, "--moe-offload-cache-layers", "4")),  # (last flag wins)
        _argv(2, *host),                                                           # 7 skip_bind
        _argv(2, *host, "--moe-offload-link-gbps", "0.001"),                       # 8 skip_wait
        _argv(2, *host),                                                           # 9 skip_rebind
        _argv(3, *ssd),                                                            # 10 skip_writeback
        _argv(2, "--moe-expert-offload", "host"),                                  # 11 skip_bind, no NaN fill
        _argv(4, *_off("ssd", tmp_path, nan_fill=False)),                          # 12 ssd, no NaN fill
    ]
    mutations = {6: "skip_unbind", 7: "skip_bind", 8: "skip_wait", 9: "skip_rebind",
                 10: "skip_writeback", 11: "skip_bind"}
    out = run_distributed(C.run_many, 2, runs, mutations, timeout_s=500)
    r = out[-1]  # the last rank prints the log lines
    ref = {k: v[0:2] + v2 for (k, v), v2 in zip(r[0]["history"].items(), r[1]["history"].values())}
    loss = lambda k: r[k]["history"]["lm_loss"]
    norm = lambda k: r[k]["history"]["grad_norm"]
    assert all(x == x for x in ref["lm_loss"]) and len(ref["lm_loss"]) == 4
    assert loss(2) == ref["lm_loss"][:2] and norm(2) == ref["grad_norm"][:2]
    assert loss(3) == ref["lm_loss"][2:3] and norm(3) == ref["grad_norm"][2:3]
    assert loss(4) == ref["lm_loss"][3:] and norm(4) == ref["grad_norm"][3:]
    assert loss(5) == ref["lm_loss"][2:] and norm(5) == ref["grad_norm"][2:]
    assert loss(6) == ref["lm_loss"] and norm(6) == ref["grad_norm"]
    assert loss(12) == ref["lm_loss"] and norm(12) == ref["grad_norm"]
    # the feature ran: every offloaded run stepped and copied experts over the link
    for k in (2, 3, 5, 6, 12):
        for rank_out in out:
            s = rank_out[k]["stats"]
            assert s["steps"] >= 1 and s["layers"] == 4 and s["link_bytes"] > 0
    for k in (3, 12):
        s = out[0][k]["stats"]
        assert s["ssd_read"] > 0 and s["ssd_written"] > 0 and s["cache_peak"] > 0
    # the log line, one per iteration. Its device figure is the arena's storage, M the experts'
    # weight storage when resident (both read from storages): K cached layers of L hold K/L of it
    lines = r[2]["lines"]
    assert len(lines) == 2
    peaks = {}
    for k, slots in ((2, 2), (3, 2), (5, 2), (6, 4), (12, 2)):
        for line in r[k]["lines"]:
            m = _LINE.search(line)
            assert m, line
            peak, resident = int(m.group(1)), int(m.group(2))
            assert peak * 4 == slots * resident and resident == r[k]["stats"]["expert_param_bytes"]
            peaks[k] = peak, resident
    bound = lambda peak, resident: 0 < peak <= resident * 2 / 4  # K = 2 of L = 4 layers
    assert all(bound(*peaks[k]) for k in (2, 3, 5, 12))
    assert not bound(*peaks[6])  # the bound is not vacuous: K = all layers breaks it
    assert float(_LINE.search(r[3]["lines"][0]).group(6)) > 0  # ssd traffic per step
    # mutations, each must break the run:
    # a forward bind, a copy wait or the backward re-bind left out -> NaN placeholders or
    # NaN-filled slots are computed on -> the run stops on a NaN loss
    for k in (7, 8, 9):
        assert _nan_stop(r[k]), (runs[k], mutations[k], r[k])
    # a host-cache write-back left out -> an update is lost -> not resident's losses (the first
    # step runs at warm-up LR 0, so iteration 3 is the first to see an update)
    assert "history" in r[10] and r[10]["history"]["lm_loss"][:2] == ref["lm_loss"][:2]
    assert r[10]["history"]["lm_loss"][2] != ref["lm_loss"][2]
    # without NaN fill the placeholder is a zero-element tensor: a missed bind fails at once
    assert "error" in r[11] or r[11].get("exit") not in (None, 0), r[11]


def test_host_tier_under_bf16_masters_step_on_the_host_grads_clipped_on_the_device(tmp_path):
    """--bf16: megatron-core's fp32 masters of offloaded experts live on the host. Its step copies
    DDP's device grads to them and clips them, which on a GPU needs device tensors (the first GPU
    run crashed there: torch refuses a CUDA grad on a host tensor, and megatron-core's clip asserts
    CUDA grads). So the masters and parameters are device stand-ins until the torch step, whose
    pre-hook binds the host copies: the spy sees stand-ins at every step; losses and grad norms
    equal resident bf16 bit for bit; leaving the host bind out (the step would update stand-ins)
    breaks the run."""
    host = _off("host", tmp_path)
    runs = [_argv(3, "--bf16"), _argv(3, "--bf16", *host), _argv(2, "--bf16", *host)]
    out = run_distributed(C.run_many_spying_masters, 2, runs, {2: "skip_host_step_bind"},
                          timeout_s=300)
    r, seen = out[-1]
    assert r[0]["history"]["lm_loss"] == r[1]["history"]["lm_loss"]
    assert r[0]["history"]["grad_norm"] == r[1]["history"]["grad_norm"]
    assert all(x == x for x in r[1]["history"]["lm_loss"]) and len(r[1]["history"]["lm_loss"]) == 3
    assert r[1]["stats"]["steps"] >= 1 and r[1]["stats"]["link_bytes"] > 0
    # three steps of run 1 (torch optimizers with offloaded masters: one per step here)
    good = [s for s in seen[:3]]
    assert len(good) == 3 and all(n > 0 and masters and params for n, masters, params in good)
    assert "error" in r[2] or r[2].get("exit") not in (None, 0), r[2]


@pytest.mark.parametrize("argv, message", [
    ("--moe-offload-dir /tmp/x", "--moe-offload-dir needs --moe-expert-offload"),
    ("--moe-expert-offload host --moe-offload-cache-layers 1", "must be >= 2"),
    ("--moe-expert-offload ssd", "needs --moe-offload-dir"),
    ("--moe-expert-offload host --moe-offload-host-cache-gb 1", "applies to --moe-expert-offload ssd"),
    ("--moe-expert-offload host --use-distributed-optimizer", "--use-distributed-optimizer"),
    ("--moe-expert-offload host --pipeline-model-parallel-size 2", "pipeline"),
    ("--moe-expert-offload ssd --moe-offload-dir /tmp/x --bf16", "--bf16"),
    ("--moe-expert-offload host --moe-offload-link-gbps 0", "must be > 0"),
])
def test_parse_time_refusals(argv, message, capsys):
    from megatron_moe.arguments import parse_args

    base = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 256 --num-experts 4 --train-iters 1 --disable-bias-linear --lr 1e-3 "
            "--moe-token-dispatcher-type alltoall ").split()
    with pytest.raises(SystemExit):
        parse_args(base + argv.split(), world_size=2, check_data_paths=False)
    assert message in capsys.readouterr().err


def test_parse_accepts_and_fills_defaults():
    from megatron_moe.arguments import parse_args

    base = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 256 --num-experts 4 --train-iters 1 --disable-bias-linear --lr 1e-3 "
            "--moe-token-dispatcher-type alltoall --moe-expert-offload ssd "
            "--moe-offload-dir /tmp/x").split()
    args = parse_args(base, world_size=2, check_data_paths=False)
    assert (args.moe_offload_cache_layers, args.moe_offload_host_cache_gb,
            args.moe_offload_cache_policy) == (2, 1.0, "lfu")


def _cache(tmp_path, policy, entries=4, numel=256, capacity_entries=3):
    from megatron_moe.offload.store import HostCache, SsdFile

    cache = HostCache(SsdFile(str(tmp_path / f"{policy}.bin")), capacity_entries * numel * 4,
                      policy=policy, decay_period=10_000)
    for k in range(entries):
        cache.add(k, torch.full((numel,), float(k)))
    return cache


def test_host_cache_lfu_beats_lru_on_a_cyclic_scan(tmp_path):
    # MoE layers are visited in a cycle longer than the cache: LRU evicts exactly the entry
    # needed next (0% hits); LFU keeps its most used entries and hits on them every cycle
    rates = {}
    for policy in ("lfu", "lru"):
        cache = _cache(tmp_path, policy)
        for _ in range(20):
            for k in range(4):
                assert cache.get(k)[0].item() == float(k)
        rates[policy] = cache.hit_rate()
        assert cache.bytes <= cache.capacity
        cache.ssd.close()
    assert rates["lru"] == 0.0 and rates["lfu"] >= 0.4


def test_host_cache_write_back_and_pins(tmp_path):
    cache = _cache(tmp_path, "lfu", capacity_entries=1)
    t = cache.get(0, pin=True)
    t.fill_(7.0)
    cache.unpin(0, dirty=True)
    cache.get(1)                      # evicts 0: written back to the file
    assert cache.writebacks == 1 and 0 not in cache.entries
    assert torch.equal(cache.get(0), torch.full((256,), 7.0))  # read back from the file
    pinned = cache.get(0, pin=True)
    cache.get(2)                      # 0 is pinned: the cache overflows instead of evicting it
    assert 0 in cache.entries and cache.overflows >= 1 and pinned[0].item() == 7.0
    cache.unpin(0)
    assert cache.bytes <= cache.capacity
    cache.ssd.close()


def test_offload_cost_model():
    from megatron_moe.balance.cost_model import OffloadCost

    # the design note's vector: bf16 on an A100 (312 TFLOP/s) over PCIe 4 (25 GB/s) -> ~12k tokens
    assert OffloadCost.min_tokens_per_expert(312e12, 2, 25e9) == 12480.0
    free = OffloadCost(layer_expert_bytes=1e6, link_bandwidth=1e9, layer_forward_s=1e-3, num_layers=4)
    slow = OffloadCost(layer_expert_bytes=4e6, link_bandwidth=1e9, layer_forward_s=1e-3, num_layers=4)
    assert free.is_free() and not slow.is_free()
    # free: only the first layer's copy is exposed; slow: the link bounds every forward layer
    assert free.step_s() == 1e-3 + free.resident_step_s()
    assert slow.step_s() == 4e-3 + 4 * (4e-3 + 4e-3) and slow.slowdown() > 2
    ssd = OffloadCost(1e6, 1e9, 1e-3, 4, ssd_read_bytes_per_layer=1e6, ssd_bandwidth=5e8)
    assert ssd.t_copy() == 1e-3 + 2e-3 and not ssd.is_free()

    # from the project's calibrated CostModel (what the planners and the simulator hold)
    from megatron_moe.balance.cost_model import CostModel

    cm = CostModel.from_profile(None)
    inputs = 4 * cm.expert_bytes / 25e9 * cm.throughput  # compute == copy of 4 experts at 25 GB/s
    at = OffloadCost.from_cost_model(cm, inputs, num_local_experts=4, num_layers=8,
                                     link_bandwidth=25e9)
    assert abs(at.t_copy() - at.layer_forward_s) < 1e-12 * at.t_copy()
    assert OffloadCost.from_cost_model(cm, 2 * inputs, 4, 8, 25e9).is_free()
    assert not OffloadCost.from_cost_model(cm, inputs / 2, 4, 8, 25e9).is_free()


def test_ddp_grad_hooks_survive_the_host_binds_of_a_cuda_run(tmp_path):
    """On CUDA, binding the experts' parameters to host memory (the host tier's step, the ssd
    tier's layer-wise step, checkpoints) changes their device, and torch then drops their
    AccumulateGrad nodes, on which megatron-core's DDP hooked the add of each grad into its buffer
    (main_grad). The second GPU run showed it: iteration 1 equal to resident, then a lower grad
    norm (the experts' grads stayed zero) and a slowly drifting loss, under host (bf16) and ssd
    (fp32) alike. The CPU shares one device, so the test makes every move between host and device
    memory drop the node as CUDA does (tests/_offload_cases.emulate_cuda_device_changes): with
    DDP's hook renewed after each host bind, losses and grad norms equal resident's bit for bit;
    with the renewal left out the run has resident's first iteration and then a lower grad norm."""
    runs = [_argv(3), _argv(3, *_off("host", tmp_path)), _argv(3, *_off("ssd", tmp_path)),
            _argv(3, "--bf16"), _argv(3, "--bf16", *_off("host", tmp_path)),
            _argv(3, *_off("host", tmp_path))]
    out = run_distributed(C.run_many_on_emulated_cuda, 2, runs, {5: "skip_renew_grad_hooks"},
                          timeout_s=400)
    r, drops = out[-1]
    loss = lambda k: r[k]["history"]["lm_loss"]
    norm = lambda k: r[k]["history"]["grad_norm"]
    assert len(loss(0)) == 3 and all(x == x for x in loss(0) + loss(3))
    for k, ref in ((1, 0), (2, 0), (4, 3)):
        assert loss(k) == loss(ref) and norm(k) == norm(ref), (k, r[k]["history"], r[ref]["history"])
        for rank_out, rank_drops in out:
            # the emulation ran (nodes dropped) and the manager renewed DDP's hooks
            assert rank_drops[k] > 0 and rank_out[k]["stats"]["grad_hooks_renewed"] > 0
            assert rank_out[k]["stats"]["steps"] == 3
    assert drops[0] == drops[3] == 0  # resident runs: nothing offloaded, nothing emulated
    # mutation: the drop is emulated, the renewal left out -> the experts' grads stop reaching DDP
    assert drops[5] > 0 and r[5]["stats"]["grad_hooks_renewed"] == 0
    assert norm(5)[0] == norm(0)[0] and loss(5)[:2] == loss(0)[:2]
    assert norm(5)[1] < norm(0)[1], (norm(5), norm(0))


def test_rehook_moves_ddps_hook_to_the_node_autograd_uses_after_the_drop():
    """torch drops a parameter's AccumulateGrad node when .data changes device or dtype (a dtype
    change here, the CPU's only way): DDP's hook on the old node then never fires again (the
    GPU's lost expert grads); compat.ddp.rehook gives the new node DDP's hook, once, in place of
    the old one in grad_accs, and leaves an intact node alone."""
    from megatron_moe.compat import ddp as D

    class FakeDDP(torch.nn.Module):  # megatron-core DDP's two members that rehook uses
        def __init__(self, module):
            super().__init__()
            self.module, self.calls, self.grad_accs = module, 0, []
            for p in module.parameters():
                node = D.grad_accumulator(p)
                node.register_hook(self._make_backward_post_hook(p))
                self.grad_accs.append(node)

        def _make_backward_post_hook(self, param):
            def hook(*unused):
                self.calls += 1
            return hook

    lin = torch.nn.Linear(3, 2, bias=False)
    ddp = FakeDDP(lin)
    p = lin.weight
    (node,) = ddp.grad_accs
    assert D.hooked_accumulators([ddp], [p]) == {p: (ddp, node)}
    backward = lambda: lin(torch.ones(1, 3)).sum().backward()
    backward()
    assert ddp.calls == 1
    assert D.rehook(ddp, p, node) is node   # intact: nothing added
    backward()
    assert ddp.calls == 2
    keep = p.data
    p.data = keep.double()                  # what p.data = host tensor does on CUDA
    p.data = keep
    backward()
    assert ddp.calls == 2                   # the hook is lost
    new = D.rehook(ddp, p, node)
    assert new is not node and ddp.grad_accs == [new]
    backward()
    assert ddp.calls == 3
