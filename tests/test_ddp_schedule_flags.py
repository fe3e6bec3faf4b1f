"""Megatron-LM's DDP and interleaved-schedule pass-through flags, each in the real training loop
on 2 gloo ranks (tiny CPU runs), each also failing under a mutation run in the spawned ranks:

* --grad-reduce-in-bf16 (with --bf16): every main_grad is bf16 (fp32 without it), the local grouped
  experts add their weight gradients into it, the losses stay within 0.1% of the fp32-reduce run;
  mutation: DDP keeps grad_reduce_in_fp32;
* --fp16: every main_grad is fp16 (Megatron-LM's rule: fp16 gradients are accumulated and reduced
  in fp16), fp32 with --accumulate-allreduce-grads-in-fp32, losses within 0.1%; mutation: DDP keeps
  grad_reduce_in_fp32;
* --ddp-average-in-collective: the data-parallel all-reduces run ReduceOp.AVG (none without it),
  the same losses as scaling then summing; mutation: the flag not given to DDP;
* --ddp-reduce-scatter-with-fp32-accumulation: megatron-core's all-to-all reduce-scatter runs
  every step, losses within 0.1% of the plain reduce-scatter; mutation: DDP never gets the flag;
* --ddp-num-buckets / --ddp-bucket-size (with --overlap-grad-reduce): DDP's gradient buckets and
  all-reduces per step follow them, the same losses; mutation: DDP gets no bucket size;
* --microbatch-group-size-per-virtual-pipeline-stage: megatron-core's interleaved schedule table
  is built with the group size given (the pipeline size without it), the same losses;
  --overlap-p2p-communication-warmup-flush reaches the config the schedule reads, same losses;
  mutations: the config keeps its default;
* with the warmup/flush overlap, an evaluation whose next stage posts its last receive only after
  the first stage let go of its last send (megatron-core never waits on that send; a dropped gloo
  send is lost): compat/cpu.py completes it, the run ends; mutation: that shim undone, the next
  stage hangs for its input (the clean-clone CI's flake, made deterministic).
"""

import math

import pytest

from megatron_moe.compat.versions import mcore_at_least
from megatron_moe.runtime.local_ranks import run_distributed
from tests import _ddp_schedule_cases as cases
from tests.test_training import TINY

EXACT = "--attention-dropout 0 --hidden-dropout 0 --train-iters 3".split()


def _run(fn, argv, mutate=None):
    return run_distributed(fn, 2, TINY + EXACT + argv, timeout_s=300, mutate=mutate)


def _close(a, b, rel):
    return all(math.isclose(x, y, rel_tol=rel) for x, y in zip(a, b)) and len(a) == len(b)


def _check_grad_dtype(reduced, fp32, dtype, mutate=None):
    """``reduced`` accumulates every main_grad in ``dtype`` and ``fp32`` in fp32, the grouped
    experts' adds into them included, losses within 0.1%; ``mutate`` applies to ``reduced``."""
    (losses, dtypes, adds, _), _ = _run(cases.train_main_grads, reduced, mutate=mutate)
    (fp32_losses, fp32_dtypes, fp32_adds, _), _ = _run(cases.train_main_grads, fp32)
    assert dtypes == [[f"torch.{dtype}"]] * 3, dtypes
    assert fp32_dtypes == [["torch.float32"]] * 3, fp32_dtypes
    assert adds > 0 and adds == fp32_adds
    assert len(set(losses)) == 3 and _close(losses, fp32_losses, 1e-3), (losses, fp32_losses)


BF16 = ["--bf16", "--moe-grouped-gemm"]
FP16 = ["--fp16", "--initial-loss-scale", "4096", "--moe-grouped-gemm"]


def _check_bf16(mutate=None):
    _check_grad_dtype(BF16 + ["--grad-reduce-in-bf16"], BF16, "bfloat16", mutate)


def _check_fp16(mutate=None):
    _check_grad_dtype(FP16, FP16 + ["--accumulate-allreduce-grads-in-fp32"], "float16", mutate)


def test_grad_reduce_in_bf16():
    _check_bf16()


def test_grad_reduce_in_bf16_mutation_fails():
    with pytest.raises(AssertionError):
        _check_bf16("bf16-ignored")


def test_fp16_gradients_reduced_in_fp16_unless_asked():
    _check_fp16()


def test_fp16_gradients_mutation_fails():
    with pytest.raises(AssertionError):
        _check_fp16("bf16-ignored")   # DDP keeps fp32 gradients


def _check_average(mutate=None):
    (summed, _, _, avg_default), _ = _run(cases.train_main_grads, [])
    (averaged, _, _, avg_calls), _ = _run(cases.train_main_grads, ["--ddp-average-in-collective"],
                                          mutate=mutate)
    assert avg_default == 0 and avg_calls >= 3, (avg_default, avg_calls)   # >= 1 per step
    assert len(set(summed)) == 3 and _close(averaged, summed, 1e-5), (averaged, summed)


def test_ddp_average_in_collective():
    _check_average()


def test_ddp_average_in_collective_mutation_fails():
    with pytest.raises(AssertionError):
        _check_average("average-ignored")


def _check_buckets(mutate=None):
    """--ddp-num-buckets N: N gradient buckets, each reduced on its own; --ddp-bucket-size: buckets
    of about that many elements; the same losses as megatron-core's default (one bucket here)."""
    overlap = ["--overlap-grad-reduce"]
    (default, one, _, one_reduce), _ = _run(cases.train_buckets, overlap)
    (three, n3, _, reduces3), _ = _run(cases.train_buckets, overlap + ["--ddp-num-buckets", "3"],
                                       mutate=mutate)
    (sized, n_sized, largest, _), _ = _run(cases.train_buckets,
                                           overlap + ["--ddp-bucket-size", "20000"])
    assert one == 1 and one_reduce == [1] * 3, (one, one_reduce)
    assert n3 == 3 and reduces3 == [3] * 3, (n3, reduces3)
    # a bucket closes at the first parameter that takes it past the size
    assert n_sized >= 4 and largest < 2 * 20000, (n_sized, largest)
    assert len(set(default)) == 3 and _close(three, default, 1e-6) and _close(sized, default, 1e-6)


def test_ddp_bucket_size_and_num_buckets():
    _check_buckets()


def test_ddp_buckets_mutation_fails():
    with pytest.raises(AssertionError):
        _check_buckets("bucket-size-ignored")


def _check_reduce_scatter_fp32(mutate=None):
    """--ddp-reduce-scatter-with-fp32-accumulation (bf16 gradients, distributed optimizer):
    megatron-core's all-to-all reduce-scatter runs (at least once per step), losses within bf16
    rounding of its plain reduce-scatter."""
    base = BF16 + ["--grad-reduce-in-bf16", "--use-distributed-optimizer"]
    (plain, plain_calls, _), _ = _run(cases.train_reduce_scatter_fp32, base)
    (fp32_acc, calls, dtypes), _ = _run(
        cases.train_reduce_scatter_fp32, base + ["--ddp-reduce-scatter-with-fp32-accumulation"],
        mutate=mutate)
    assert plain_calls == 0 and calls >= 3, (plain_calls, calls)
    assert dtypes == ["torch.bfloat16"], dtypes
    assert len(set(plain)) == 3 and _close(fp32_acc, plain, 1e-3), (fp32_acc, plain)


def test_reduce_scatter_with_fp32_accumulation():
    _check_reduce_scatter_fp32()


def test_reduce_scatter_with_fp32_accumulation_mutation_fails():
    with pytest.raises(AssertionError):
        _check_reduce_scatter_fp32("rs-fp32-ignored")


PP_VP = ("--pipeline-model-parallel-size 2 --num-layers 4 "
         "--num-layers-per-virtual-pipeline-stage 1").split()   # 2 stages x 2 chunks, 4 micro-batches


def _check_schedule(mutate=None):
    base, groups, flush = _run(cases.train_interleaved, PP_VP)[1]
    assert set(groups) == {2} and flush == [False] * 3, (groups, flush)   # default: PP
    assert len(set(base)) == 3
    # one flag a run: megatron-core's forward-only interleaved schedule (evaluation) stalls with
    # both here (training/pipeline_schedule.py's docstring)
    group = ["--microbatch-group-size-per-virtual-pipeline-stage", "4"]
    losses, groups, flush = _run(cases.train_interleaved, PP_VP + group, mutate=mutate)[1]
    assert groups and set(groups) == {4} and flush == [False] * 3, (groups, flush)
    assert _close(losses, base, 1e-5), (losses, base)
    losses, groups, flush = _run(cases.train_interleaved,
                                 PP_VP + ["--overlap-p2p-communication-warmup-flush"],
                                 mutate=mutate)[1]
    assert set(groups) == {2} and flush == [True] * 3, (groups, flush)
    assert _close(losses, base, 1e-5), (losses, base)


def test_interleaved_schedule_options():
    _check_schedule()


@pytest.mark.parametrize("mutate", ["group-ignored", "flush-ignored"])
def test_interleaved_schedule_options_mutation_fails(mutate):
    with pytest.raises(AssertionError):
        _check_schedule(mutate)


@pytest.mark.parametrize("flags, message", [
    ("--overlap-p2p-communication-warmup-flush", "needs virtual pipeline stages"),
    ("--microbatch-group-size-per-virtual-pipeline-stage 2", "needs virtual pipeline stages"),
    (" ".join(PP_VP) + " --microbatch-group-size-per-virtual-pipeline-stage 1", "must be in"),
    (" ".join(PP_VP) + " --microbatch-group-size-per-virtual-pipeline-stage 3", "last group of 1"),
    ("--ddp-average-in-collective --calculate-per-token-loss", "--calculate-per-token-loss"),
    ("--ddp-num-buckets 2 --ddp-bucket-size 1000", "cannot be used with --ddp-bucket-size"),
    ("--ddp-num-buckets 0", "must be greater than 0"),
    ("--ddp-reduce-scatter-with-fp32-accumulation", "needs --use-distributed-optimizer"),
    (" ".join(PP_VP) + " --microbatch-group-size-per-virtual-pipeline-stage 4 "
     "--overlap-p2p-communication-warmup-flush", "stalls with both"),
])
def test_refused_at_parse_time(flags, message, capsys):
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(TINY + ["--train-iters", "4"] + flags.split(), world_size=2)
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 2, err


def test_megatrons_accumulate_flag_rule():
    from megatron_moe.arguments import parse_args

    def accumulate(flags):
        return parse_args(TINY + ["--train-iters", "4"] + flags.split(),
                          world_size=1).accumulate_allreduce_grads_in_fp32

    # --bf16: on unless --grad-reduce-in-bf16; --fp16 (and fp32): as given
    assert accumulate("--bf16") and accumulate("--bf16 --accumulate-allreduce-grads-in-fp32")
    assert not accumulate("--fp16") and accumulate("--fp16 --accumulate-allreduce-grads-in-fp32")
    assert not accumulate("") and not accumulate("--grad-reduce-in-bf16")
    assert not accumulate("--bf16 --grad-reduce-in-bf16")
    assert not accumulate("--bf16 --grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32")


def _check_late_receiver(tmp_path, mutate=None):
    """The first evaluation's forward-only schedule with rank 1 late for its last input (posted
    only after rank 0 let go of its last send, tests/_ddp_schedule_cases.py): it completes
    because compat/cpu.py keeps gloo pipeline sends until waited."""
    last_recv = 4 * 2   # rank 1 receives each of its 4 micro-batches' inputs for each of 2 chunks
    argv = TINY + EXACT + PP_VP + ["--overlap-p2p-communication-warmup-flush",
                                   "--train-iters", "1"]
    (losses, completed, gated), (_, _, gated_1) = run_distributed(
        cases.evaluate_with_late_receiver, 2, argv, str(tmp_path / "rank0-sends-released"),
        last_recv, timeout_s=300, mutate=mutate,
        collective_timeout_s=5 if mutate else 120)   # the mutation hangs: fail it fast
    assert gated == 0 and gated_1 == 1, (gated, gated_1)   # rank 1 was late, once
    # core_v0.16: one per schedule (1 training step, 2 evaluations), the send megatron-core left
    # unwaited; core_v0.19 waits on each send itself under deallocate_pipeline_outputs
    # (Megatron-LM's setting, the builder's too)
    assert completed == (0 if mcore_at_least("0.19") else 3), completed
    assert len(losses) == 1 and math.isfinite(losses[0]), losses


def test_evaluation_survives_a_late_receiver(tmp_path):
    _check_late_receiver(tmp_path)


@pytest.mark.skipif(mcore_at_least("0.19"), reason="megatron-core 0.19 waits on every pipeline "
                    "send itself under deallocate_pipeline_outputs: no send is left to drop")
def test_late_receiver_mutation_fails(tmp_path):
    from megatron_moe.runtime.local_ranks import DistributedRunError

    with pytest.raises(DistributedRunError) as failed:
        _check_late_receiver(tmp_path, "sends-dropped")
    # a dropped send is lost (the clean-clone CI's hang: rank 1 waits for its last input, rank 0
    # in the next collective), or its freed output (deallocate_pipeline_outputs) is sent: a NaN
    message = str(failed.value)
    assert ("Timed out" in message and "forward_backward_pipelining_with_interleaving" in message
            ) or "loss is nan" in message, message[-2000:]
