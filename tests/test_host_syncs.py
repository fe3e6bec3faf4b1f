"""No host reads of device data in our hot path (docs/gpu.md, "Host syncs").

The real pretrain() loop runs on 2 gloo ranks (EP=2, alltoall dispatcher) under
tests/_sync_counter.py's counter; every host read (``.item()``/``float()``/``bool()`` on a tensor,
``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")``, data-sized ops such as ``nonzero``: each a
``cudaStreamSynchronize`` on a GPU) is attributed to our code or megatron-core's. In an iteration
that prints no log line, our code reads nothing, except the listed, justified reads below. A
mutation that brings back a per-step read (the router hook's counts, the losses) fails the check.
"""

import re

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _sync_cases as S

LOG_INTERVAL, ITERS, LAYERS, MICRO_BATCHES = 3, 6, 2, 2   # 8 global / (2 micro x DP 2) = 2
# after training, --eval-iters (1) global batches of the validation and of the test set
EVAL_BATCHES = 2

VALIDATING = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 --moe-router-topk 2 "
        "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 "
        f"--log-interval {LOG_INTERVAL} --eval-interval 1000 --eval-iters 1 --disable-bias-linear "
        f"--expert-model-parallel-size 2 --train-iters {ITERS}").split()
# the MoE hot path alone: result validation (--rerun-mode validate_results, Megatron's default)
# adds its own reads per iteration, counted in test_result_validation_reads_once_per_iteration
BASE = VALIDATING + ["--rerun-mode", "disabled"]
# cross-node telemetry on (two emulated nodes) and the congestion router (it used to ask the host
# whether its cap binds)
TELEMETRY = BASE + "--ranks-per-node 1 --moe-router-topology congestion".split()

# Our per-iteration reads that stay, each one per MoE layer per micro-batch, with why.
ALLOWED = {
    # --moe-balance-policy: the balanced layer replaces megatron-core's dispatcher and reads its
    # all-gathered [source rank x expert] count matrix once: the host needs it for the all-to-all
    # split sizes and the replica routing, as megatron-core's alltoall dispatcher does its splits
    ("megatron_moe/balance/layer.py", "_plan"): "the balanced all-to-all's split sizes",
    # --moe-a2a-overlap-degree: the chunked exchange reads its send and receive counts per
    # (rank, local expert) in one read: the host slices them into chunks and split sizes
    ("megatron_moe/moe/chunked.py", "split_counts"): "the chunked all-to-all's split sizes",
}
BALANCE_READ = ("megatron_moe/balance/layer.py", "_plan")
CHUNKED_READ = ("megatron_moe/moe/chunked.py", "split_counts")

_READ = re.compile(r"^(?P<what>\S+) at (?P<file>[^:]+):(?P<line>\d+) (?P<func>\S+)$")


def hot_path_reads(run):
    """Our reads in the iterations that print no log line: {iteration: [read, ...]}, the allowed
    ones left out, and {(file, function): count per iteration} of the allowed ones."""
    unexpected, allowed = {}, {}
    for it, reads in run["reads"]["ours"].items():
        if it is None or it % LOG_INTERVAL == 0 or it == ITERS:
            continue
        for read in reads:
            m = _READ.match(read)
            key = (m["file"], m["func"])
            if key in ALLOWED:
                allowed.setdefault(key, {}).setdefault(it, 0)
                allowed[key][it] += 1
            else:
                unexpected.setdefault(it, []).append(read)
    return unexpected, allowed


def _assert_counter_is_live(run):
    # megatron-core's alltoall dispatcher reads its split sizes in every iteration, and a log
    # iteration shows our reads for the log line (expert loads, loss scale): the counter sees reads
    core = run["reads"]["megatron-core"]
    assert all(core.get(it) for it in range(1, ITERS + 1)), core.keys()
    assert any("telemetry.py" in r and " collect" in r
               for r in run["reads"]["ours"][LOG_INTERVAL]), run["reads"]["ours"][LOG_INTERVAL]


@pytest.mark.parametrize("mutate", [None, "telemetry_item", "loss_per_step"])
def test_no_host_reads_in_iterations_without_a_log_line(mutate):
    run = run_distributed(S.run_counted, 2, [(TELEMETRY, mutate)], timeout_s=300)[-1][0]
    _assert_counter_is_live(run)
    losses = run["history"]["lm_loss"]
    assert len(losses) == ITERS and all(l == l for l in losses), losses
    unexpected, allowed = hot_path_reads(run)
    assert not allowed
    quiet = [it for it in range(1, ITERS) if it % LOG_INTERVAL]
    if mutate is None:
        assert unexpected == {}, unexpected
    elif mutate == "telemetry_item":   # one per router call: layers x micro-batches
        assert sorted(unexpected) == quiet
        assert all(len(r) == LAYERS * MICRO_BATCHES and all(" hook" in x for x in r)
                   for r in unexpected.values()), unexpected
    else:                               # the losses read every iteration
        assert sorted(unexpected) == quiet
        assert all(len(r) == 1 and "reduce_losses" in r[0] for r in unexpected.values()), unexpected


def test_balanced_layer_and_grouped_experts_read_only_their_splits():
    from megatron_moe.moe.grouped_experts import FLAG as GROUPED

    balance = BASE + "--moe-balance-policy proprophet --moe-balance-overlap".split()
    grouped = BASE + [GROUPED, "--moe-ffn-hidden-size", "16"]
    out = run_distributed(S.run_counted, 2, [(balance, None), (grouped, None)], timeout_s=400)
    for rank_out in out:
        bal, grp = rank_out
        unexpected, allowed = hot_path_reads(bal)
        assert unexpected == {}, unexpected
        # exactly one read of the count matrix per MoE layer per micro-batch
        quiet = [it for it in range(1, ITERS) if it % LOG_INTERVAL]
        assert allowed == {BALANCE_READ: {it: LAYERS * MICRO_BATCHES for it in quiet}}
        unexpected, allowed = hot_path_reads(grp)
        assert unexpected == {} and not allowed, (unexpected, allowed)
        _assert_counter_is_live(grp)
        # the grouped path ran: every training and evaluation forward
        assert grp["grouped_calls"] == (ITERS + EVAL_BATCHES) * LAYERS * MICRO_BATCHES
        # megatron-core's no-apex norm reads every parameter's norm on the host; on the CPU those
        # reads happen inside torch.tensor(), below the counter (tests/test_multi_tensor.py
        # counts them with the profiler): here, that the foreach norm is what the run used
        assert grp["l2_norm_impl"] == "foreach_l2_norm"


@pytest.mark.parametrize("mutate", [None, "chunked_two_reads"])
def test_chunked_layer_reads_its_counts_once_per_layer_and_micro_batch(mutate):
    chunked = BASE + "--moe-a2a-overlap-degree 2".split()
    for run, in run_distributed(S.run_counted, 2, [(chunked, mutate)], timeout_s=300):
        _assert_counter_is_live(run)
        losses = run["history"]["lm_loss"]
        assert len(losses) == ITERS and all(l == l for l in losses), losses
        unexpected, allowed = hot_path_reads(run)
        quiet = [it for it in range(1, ITERS) if it % LOG_INTERVAL]
        if mutate is None:
            assert unexpected == {}, unexpected
            assert allowed == {CHUNKED_READ: {it: LAYERS * MICRO_BATCHES for it in quiet}}, allowed
        else:   # the stand-in's two reads per layer per micro-batch, the allowed one gone
            assert not allowed, allowed
            assert sorted(unexpected) == quiet
            assert all(len(r) == 2 * LAYERS * MICRO_BATCHES and all(" split_counts" in x for x in r)
                       for r in unexpected.values()), unexpected


@pytest.mark.parametrize("mutate", [None, "mcore_permute"])
def test_one_rank_with_grouped_experts_reads_only_the_grad_norm(mutate):
    """Expert and tensor parallel size 1, grouped experts, dropless (the perf section's rows): an
    iteration without a log line reads one value on the host in all, megatron-core's grad norm (no
    dispatcher split sizes: compat/dispatch.py keep_counts_on_device; on megatron-core 0.16 no
    masked_select in its permute: argsort_permute)."""
    from megatron_moe.compat.versions import mcore_at_least
    from megatron_moe.moe.grouped_experts import FLAG as GROUPED

    if mutate and mcore_at_least("0.17"):
        pytest.skip("megatron-core >= 0.17 permutes by argsort itself: no binding to take away")
    at = BASE.index("--expert-model-parallel-size")
    argv = BASE[:at] + BASE[at + 2:] + [GROUPED, "--moe-ffn-hidden-size", "16"]
    run, = run_distributed(S.run_counted, 1, [(argv, mutate)], timeout_s=300)[0]
    micro_batches = 4   # global 8 / micro 2 / DP 1
    assert run["grouped_calls"] == (ITERS + EVAL_BATCHES) * LAYERS * micro_batches
    quiet = [it for it in range(2, ITERS) if it % LOG_INTERVAL]   # 1 also sets up megatron-core
    core = run["reads"]["megatron-core"]
    assert all(not run["reads"]["ours"].get(it) for it in quiet), run["reads"]["ours"]
    for it in quiet:
        names = [r.split()[-1] for r in core[it]]
        if mutate is None:
            assert names == ["get_grad_norm_fp32"], core[it]
        else:   # tokens and probs, per layer per micro-batch
            assert names.count("permute") == 2 * LAYERS * micro_batches, core[it]


def test_kit_sync_counter_counts_torch_sync_warnings_per_iteration():
    """The GPU kit's counter (megatron_moe/gpucheck/syncs.py) on what torch's sync debug mode emits
    on CUDA: every 'called a synchronizing CUDA operation' warning, labelled with the iteration and
    the call site; other warnings pass through uncounted."""
    import warnings

    from megatron_moe.gpucheck.syncs import SyncCounter

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with SyncCounter() as c:
            for it in (1, 2):
                c.phase = it
                for _ in range(it):
                    warnings.warn("called a synchronizing CUDA operation")   # same site twice
            warnings.warn("something else")
    assert c.per_phase() == {1: {"total": 1, "ours": 0, "megatron-core": 0, "other": 1},
                             2: {"total": 2, "ours": 0, "megatron-core": 0, "other": 2}}
    (site, per), = c.sites([1, 2])
    assert "tests/test_host_syncs.py" in site and per == 1.5
    assert [str(w.message) for w in shown] == ["something else"]


def test_result_validation_reads_once_per_iteration():
    """--rerun-mode validate_results (the default): the losses of all micro-batches come to the
    host in one read after the forward-backward (training/result_validation.py); megatron-core
    reads its NaN and Inf tests of each gradient bucket's norm (Megatron-LM's DDP check, once per
    iteration) and all-reduces its re-run verdict (one read). Megatron-LM's loss function instead
    has megatron-core read a NaN and an Inf test of every micro-batch's loss (the mutation): 2 more
    reads per micro-batch. All of them are reads a GPU run pays for; ours does not grow with the
    micro-batches."""
    plain, inline = run_distributed(S.run_counted, 2, [(VALIDATING, None),
                                                       (VALIDATING, "validate_inline")],
                                    timeout_s=400)[-1]
    quiet = [it for it in range(2, ITERS) if it % LOG_INTERVAL]   # megatron-core skips the first
    for run in (plain, inline):
        _assert_counter_is_live(run)
    ours, _ = hot_path_reads(plain)
    mutated_ours, _ = hot_path_reads(inline)
    for it in quiet:
        names = [r.split()[-1] for r in plain["reads"]["megatron-core"][it]]
        mutated = [r.split()[-1] for r in inline["reads"]["megatron-core"][it]]
        assert names.count("_reduce_any") == mutated.count("_reduce_any") == 1, names
        assert [r.split()[-1] for r in ours[it]] == ["validate_recorded"], ours
        grads = names.count("validate_result")   # 2 per gradient bucket, the same in both runs
        assert grads >= 2 and grads % 2 == 0, names
        assert not mutated_ours.get(it), mutated_ours
        assert mutated.count("validate_result") == grads + 2 * MICRO_BATCHES, mutated
