"""Megatron-LM's result validation (--rerun-mode) on megatron-core's RerunStateMachine, driven by
megatron-core's own fault injection (--error-injection-rate / --error-injection-type) on a tiny
GPT-MoE (EP=2, dropout on) on 2 CPU ranks: what each injected fault does, Megatron's exit codes
and messages, the rerun checkpoint and its resume, and the rerun configs of Megatron-LM's
functional tests parsing here."""

import json
import os

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._rerun_cases import ARGV, run_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERS = 4
EVAL_FB = 2   # after training: one validation and one test batch (--eval-iters 1)
INJECT = ["--error-injection-rate", "1"]   # every validation from iteration 2 on (the first is never)
# the loss diverges to NaN at iteration 2 (tests/test_training.py's NaN test)
DIVERGE = ["--lr", "1e9", "--clip-grad", "0", "--init-method-std", "5"]
GRADS_ONLY = ["--no-check-for-nan-in-loss-and-grad", "--check-for-large-grads"]
SPIKY_ONLY = ["--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss"]   # non-fatal


def _has(log, text):
    return any(text in line for line in log)


def test_injected_faults_and_modes():
    base = ARGV + ["--train-iters", str(ITERS)]
    steps = [
        dict(argv=base),                                                   # 0 uninjected
        dict(argv=base + INJECT + SPIKY_ONLY),                             # 1 transient, non-fatal
        dict(argv=base + INJECT + SPIKY_ONLY, mutate="skip_reruns"),       # 2 mutation
        dict(argv=base + INJECT + ["--rerun-mode", "disabled"]),           # 3 disabled
        dict(argv=base + INJECT),                                          # 4 transient, fatal (NaN)
        dict(argv=base + ["--rerun-mode", "report_stats"]),                # 5 statistics
        dict(argv=base + DIVERGE),                                         # 6 a real NaN loss
        dict(argv=base + INJECT + GRADS_ONLY),                             # 7 large-grads check
        dict(argv=base + INJECT + GRADS_ONLY, mutate="no_large_grads_check"),  # 8 mutation
        dict(argv=base + INJECT + SPIKY_ONLY, mutate="skip_validation"),   # 9 mutation
    ]
    runs = run_distributed(run_steps, 2, steps, timeout_s=900)
    for rank, (plain, transient, mutated, disabled, fatal, stats, nan, grads,
               grads_off, unvalidated) in enumerate(runs):
        assert plain["exit"] is None and plain["fb_calls"] == ITERS + EVAL_FB
        # a transient fault in a non-fatal validation: iterations 2..4 each run again, the re-run
        # (RNG and batches restored) gives the uninjected run's losses, and training continues
        assert transient["exit"] is None
        assert transient["fb_calls"] == plain["fb_calls"] + (ITERS - 1), transient["log"]
        assert transient["losses"] == plain["losses"]
        assert _has(transient["log"], "Possible transient error!")
        # mutations: the loop skips megatron-core's re-run, or the recorded losses' validation:
        # no re-run, no diagnosis
        for broken in (mutated, unvalidated):
            assert broken["fb_calls"] == plain["fb_calls"]
            assert not _has(broken["log"], "Possible transient error!")
        # --rerun-mode disabled: the injector is never consulted (megatron-core's disabled mode)
        assert disabled["losses"] == plain["losses"] and disabled["fb_calls"] == plain["fb_calls"]
        assert not _has(disabled["log"], "Injecting error")
        # a transient fault in a fatal NaN validation: Megatron's exit status 17 after the re-run.
        # The first validation of an iteration is megatron-core DDP's NaN test of the first
        # gradient bucket's norm (it runs inside the backward), so the injector picks that one
        assert fatal["exit"] == 17 and fatal["losses"] is None
        assert fatal["fb_calls"] == 3   # iteration 1, iteration 2 and its re-run
        assert _has(fatal["log"], "Possible transient error!")
        assert _has(fatal["log"], "message='found NaN in local grad norm for bucket #0")
        # report_stats: every iteration runs twice and megatron-core logs the variability
        assert stats["exit"] is None and stats["losses"] == plain["losses"]
        assert stats["fb_calls"] == 2 * ITERS + EVAL_FB
        if rank == 0:   # megatron-core gathers and logs the statistics on rank 0
            assert _has(stats["log"], "Stats on computation determinism in validation calls")
            assert _has(stats["log"], "samples, all identical") or _has(stats["log"], "total/identical")
        # a real NaN loss reproduces in place: Megatron's "resume to re-run elsewhere" (16)
        assert nan["exit"] == 16, nan["log"]
        assert _has(nan["log"], "First rerun: unexpected result is reproducible within the tolerance")
        # --check-for-large-grads: megatron-core's DDP validates each bucket's grad norm (the
        # only validation here, so the injected transient fault lands on it): non-fatal re-runs
        assert grads["losses"] == plain["losses"], grads["log"]
        assert grads["fb_calls"] == plain["fb_calls"] + (ITERS - 1)
        assert _has(grads["log"], "found unexpected large grads in bucket #0")
        # mutation: the flag not passed to the DDP config: nothing validated, nothing re-run
        assert grads_off["fb_calls"] == plain["fb_calls"]
        assert not _has(grads_off["log"], "large grads")
    assert _has(runs[0][1]["log"], "Injecting error type Transient error")


def test_persistent_fault_rerun_checkpoint_and_resume(tmp_path):
    """A persistent fault: reproducible in place -> rerun checkpoint + exit 16; the resumed job
    re-runs the iteration: on the same device it asks to be resumed again (16), on another node it
    diagnoses the persistent error (17); another parallel layout ignores the state. Mutation: the
    checkpoint's machine state not loaded."""
    ckpt = str(tmp_path / "ckpt")
    tracker = str(tmp_path / "rejected.txt")
    argv = ARGV + ["--train-iters", str(ITERS), "--save", ckpt, "--save-interval", "100",
                   "--error-injection-rate", "1", "--error-injection-type", "persistent_error",
                   "--result-rejected-tracker-filename", tracker]
    resume = argv + ["--load", ckpt]
    steps = [dict(argv=argv), dict(argv=resume), dict(argv=resume, mutate="other_node"),
             dict(argv=resume, mutate="drop_rerun_state"),
             dict(argv=resume + ["--expert-model-parallel-size", "1"])]   # another layout
    runs = run_distributed(run_steps, 2, steps, timeout_s=900)
    for first, same_device, other_node, dropped, resharded in runs:
        assert first["exit"] == 16, first["log"]
        assert _has(first["log"], "First rerun: unexpected result is reproducible within the tolerance")
        # the same GPU again: megatron-core asks for another resume from the same checkpoint
        assert same_device["exit"] == 16, same_device["log"]
        assert _has(same_device["log"], "Got rescheduled on the same GPU")
        assert other_node["exit"] == 17, other_node["log"]
        assert _has(other_node["log"], "Possible persistent error!")
        # mutation: without the machine's state the resume trains iteration 2 afresh (a job's
        # first iteration is not validated), the injector fires again at iteration 3 as on a
        # first run, and no diagnosis is reached
        assert dropped["exit"] == 16 and not _has(dropped["log"], "Got rescheduled")
        assert not _has(dropped["log"], "Possible persistent error!")
        # another parallel layout ignores the machine's state (Megatron-LM's rule): the loaded
        # iteration trains afresh, the injector fires on the next one
        assert resharded["exit"] == 16 and not _has(resharded["log"], "Got rescheduled")
    assert _has(runs[0][0]["log"], "Saving a checkpoint and exiting now")
    assert "Job sharding has changed: Rerun state will be ignored" in runs[0][4]["text"]
    # the rerun checkpoint holds the iteration before the failing one (2), with the machine's state
    # (the mutated run then wrote iteration 2's, before its failing iteration 3)
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(os.path.join(ckpt, "iter_0000001"))
    assert common["rerun_state_machine"]["state"].name == "WILL_RERUN_FROM_CHECKPOINT"
    lines = open(tracker).read().splitlines()
    assert any("status=RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE" in l or
               "status=first_rerun_reproducible" in l for l in lines), lines


def test_resume_with_validation_on_is_exact(tmp_path):
    """validate_results (the default) on: 2 iterations + save + exit, resumed to 4, give the losses of 4
    straight iterations (dropout on: the RNG state and the machine's state are restored)."""
    ckpt = str(tmp_path / "ckpt")
    base = ARGV + ["--check-for-spiky-loss", "--train-iters", "4"]
    steps = [dict(argv=base),
             dict(argv=base + ["--save", ckpt, "--exit-interval", "2"]),
             dict(argv=base + ["--load", ckpt])]
    runs = run_distributed(run_steps, 2, steps, timeout_s=900)
    for straight, first, resumed in runs:
        assert first["losses"] + resumed["losses"] == straight["losses"]
        assert resumed["fb_calls"] == 2 + EVAL_FB
    assert _has(runs[0][2]["log"], "Result validation enabled")   # logged by rank 0


def test_megatron_rerun_configs_parse():
    """The rerun engine's flags of Megatron-LM's gpt3_mcore_reruns_* functional tests parse here
    to Megatron's values (tests/data/megatron_reruns_configs.json: tools/extract_megatron_moe_configs.py
    --reruns-output, at core_v0.19.0)."""
    from megatron_moe.arguments import parse_args

    data = json.load(open(os.path.join(ROOT, "tests", "data", "megatron_reruns_configs.json")))
    configs = {n: c["argv"] for n, c in data["configs"].items() if c["argv"]}
    assert len(configs) >= 7, sorted(configs)
    for name, flags in configs.items():
        args = parse_args(ARGV + ["--train-iters", "1"] + flags, world_size=2)
        given = dict(zip(flags[::2], flags[1::2]))
        assert args.rerun_mode == given["--rerun-mode"], name
        assert args.error_injection_rate == int(given.get("--error-injection-rate", 0)), name
        assert args.error_injection_type == given.get("--error-injection-type", "transient_error")
    defaults = parse_args(ARGV + ["--train-iters", "1"], world_size=2)
    assert defaults.rerun_mode == "validate_results" and defaults.error_injection_rate == 0
    assert not defaults.check_for_spiky_loss and not defaults.check_for_large_grads


@pytest.mark.parametrize("flags, message", [
    (["--rerun-mode", "sometimes"], "argument --rerun-mode: invalid choice"),
    (["--error-injection-type", "cosmic_ray"], "argument --error-injection-type: invalid choice"),
    (["--error-injection-rate", "-1"], "--error-injection-rate must be >= 0"),
    (["--result-rejected-tracker-filename", "/nonexistent/dir/x.txt"],
     "--result-rejected-tracker-filename /nonexistent/dir/x.txt: cannot append"),
])
def test_bad_values_refused_at_parse_time(flags, message, capsys):
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(ARGV + ["--train-iters", "1"] + flags, world_size=2)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_transient_fault_rerun_with_interleaved_pipeline():
    """PP=2 with two virtual stages per rank: only the last stage validates its loss, every stage
    re-runs (one re-wound reader per model chunk), and the losses are the uninjected run's; they
    are not when the re-run leaves the model-parallel RNG tracker (attention dropout) as it was
    (the mutation: result_validation's state_restore_func skipped)."""
    base = ARGV + ["--train-iters", str(ITERS), "--num-layers", "4", "--expert-model-parallel-size",
                   "1", "--pipeline-model-parallel-size", "2",
                   "--num-layers-per-virtual-pipeline-stage", "1"]
    steps = [dict(argv=base), dict(argv=base + INJECT + SPIKY_ONLY),
             dict(argv=base + INJECT + SPIKY_ONLY, mutate="no_tracker_restore")]
    runs = run_distributed(run_steps, 2, steps, timeout_s=900)
    for plain, transient, unrestored in runs:
        assert plain["exit"] is None and transient["exit"] is None
        assert transient["losses"] == plain["losses"]
        assert transient["fb_calls"] == plain["fb_calls"] + (ITERS - 1)
        # mutation: the RNG tracker (attention dropout) not restored: the re-runs drift
        assert unrestored["losses"] != plain["losses"]
    assert _has(runs[1][1]["log"], "Possible transient error!")   # the last stage's diagnosis
