"""--optimizer muon builds megatron-core's Muon (megatron-core >= 0.19 with emerging-optimizers)
from Megatron-LM's --muon-* flags, trains a tiny GPT-MoE and resumes exactly from a checkpoint;
on megatron-core 0.16.1 (no Muon) it is refused at parse time with one line naming the release.

Proof that the path ran: the chained optimizer holds megatron-core's Muon (its class), and a
mutation that drops --muon-momentum on its way to the OptimizerConfig changes the losses."""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import TINY

MUON = ["--optimizer", "muon", "--muon-momentum", "0.5", "--muon-num-ns-steps", "5",
        "--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "1.0",
        "--hidden-dropout", "0", "--attention-dropout", "0"]


def _muon_supported():
    from megatron_moe.compat.versions import mcore_at_least

    return mcore_at_least("0.19")


def _runs(rank, world_size, argvs, mutated):
    """pretrain() runs in sequence, recording the optimizer classes megatron-core built; run
    number ``mutated`` drops --muon-momentum on its way to the OptimizerConfig."""
    import megatron.core.optimizer as mcore_optimizer
    import pretrain_gpt_moe
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType

    from megatron_moe.compat import optimizer as compat_optimizer
    from megatron_moe.training.loop import pretrain

    real_get, real_kwargs = mcore_optimizer.get_megatron_optimizer, \
        compat_optimizer.emerging_optimizer_kwargs
    classes = []

    def recording(config, model, *a, **k):
        opt = real_get(config, model, *a, **k)
        classes.append([type(opt).__name__] + sorted({
            type(getattr(o, "optimizer", o)).__name__
            for o in getattr(opt, "chained_optimizers", [opt])}))
        return opt

    def momentum_dropped(args):  # mutation: megatron-core's default muon_momentum acts instead
        kwargs = real_kwargs(args)
        kwargs.pop("muon_momentum")
        return kwargs

    mcore_optimizer.get_megatron_optimizer = recording
    out = []
    try:
        for k, argv in enumerate(argvs):
            parallel_state.destroy_model_parallel()
            compat_optimizer.emerging_optimizer_kwargs = \
                momentum_dropped if k == mutated else real_kwargs
            result = pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                              pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                              pretrain_gpt_moe.forward_step, argv=argv)
            out.append(result["history"])
    finally:
        mcore_optimizer.get_megatron_optimizer = real_get
        compat_optimizer.emerging_optimizer_kwargs = real_kwargs
    return out, classes


def test_muon_trains_and_resumes(tmp_path):
    if not _muon_supported():
        pytest.skip("megatron-core < 0.19 has no Muon (test_muon_refused_without_megatron_core_muon)")
    pytest.importorskip("emerging_optimizers")
    ckpt = str(tmp_path / "ckpt")
    base = TINY + MUON + ["--train-iters", "4"]
    runs = [base + ["--save", ckpt, "--save-interval", "2"],
            base + ["--load", ckpt, "--ckpt-step", "2"], base]
    (full, resumed, mutated), classes = run_distributed(_runs, 1, runs, 2, timeout_s=500)[0]
    print("muon lm_loss", full["lm_loss"], "mutated", mutated["lm_loss"], "classes", classes)
    assert classes[0] == ["ChainedOptimizer", "AdamW", "TensorParallelMuon"], classes   # megatron-core's Muon built the step
    losses = full["lm_loss"]
    assert full["iteration"] == [1, 2, 3, 4] and losses[-1] < losses[0], losses
    assert resumed["iteration"] == [3, 4]
    assert resumed["lm_loss"] == losses[2:] and resumed["grad_norm"] == full["grad_norm"][2:]
    # the mutation (--muon-momentum 0.5 not handed over): same first step, then other losses
    assert mutated["lm_loss"][0] == losses[0] and mutated["lm_loss"][1:] != losses[1:]


def test_dist_muon_layer_wise_matches_muon_and_resumes(tmp_path):
    """2 gloo ranks, bf16: dist_muon (Megatron-LM's muon + layer-wise distributed optimizer; each
    rank updates whole params and all-gathers them, uneven sizes: compat/cpu.py) trains like
    plain Muon over data parallelism, and resumes from its checkpoint exactly."""
    if not _muon_supported():
        pytest.skip("megatron-core < 0.19 has no Muon (test_muon_refused_without_megatron_core_muon)")
    pytest.importorskip("emerging_optimizers")
    ckpt = str(tmp_path / "ckpt")
    base = TINY + MUON + ["--train-iters", "4", "--bf16"]
    dist = base + ["--optimizer", "dist_muon"]
    runs = [dist + ["--save", ckpt, "--save-interval", "2"],
            dist + ["--load", ckpt, "--ckpt-step", "2"], base]
    (full, resumed, plain), classes = run_distributed(_runs, 2, runs, -1, timeout_s=500)[0]
    print("dist_muon lm_loss", full["lm_loss"], "muon", plain["lm_loss"], "classes", classes)
    assert classes[0] == ["LayerWiseDistributedOptimizer", "AdamW", "TensorParallelMuon"], classes
    assert classes[2][0] == "ChainedOptimizer"
    assert full["lm_loss"] == plain["lm_loss"] and full["lm_loss"][-1] < full["lm_loss"][0]
    assert resumed["iteration"] == [3, 4] and resumed["lm_loss"] == full["lm_loss"][2:]
    # mutation: megatron-core's layer-wise optimizer without the CPU shim (compat/cpu.py) fails
    with pytest.raises(Exception, match="cuda|CUDA|allgather|all_gather"):
        run_distributed(_without_layer_wise_shim, 2, [dist], timeout_s=300)


def _without_layer_wise_shim(rank, world_size, argvs):
    import torch
    from megatron.core.optimizer import layer_wise_optimizer

    from megatron_moe.compat import cpu

    cpu.apply()
    layer_wise_optimizer.torch = torch   # undo patch_layer_wise_optimizer (apply() is idempotent)
    return _runs(rank, world_size, argvs, -1)


@pytest.mark.parametrize("optimizer", ["muon", "dist_muon"])
def test_muon_refused_without_megatron_core_muon(optimizer, capsys):
    """megatron-core 0.16.1: one line naming the release; 0.19 without emerging-optimizers: one
    line naming the package; 0.19 with it: parsed, dist_muon as Megatron-LM's muon + layer-wise,
    which needs --bf16 (one line without it)."""
    from megatron_moe.arguments import parse_args

    argv = TINY + ["--optimizer", optimizer, "--muon-momentum", "0.5", "--train-iters", "4",
                   "--bf16"]
    if _muon_supported():
        try:
            import emerging_optimizers  # noqa: F401
        except ImportError:
            expected = f"--optimizer {optimizer} needs the emerging-optimizers package"
        else:
            args = parse_args(argv, world_size=1)
            assert args.optimizer == "muon" and args.muon_momentum == 0.5
            assert args.use_layer_wise_distributed_optimizer == (optimizer == "dist_muon")
            if optimizer == "muon":
                return
            expected = "--optimizer dist_muon (or muon with --use-distributed-optimizer) needs --bf16"
            argv = [a for a in argv if a != "--bf16"]
    else:
        expected = f"--optimizer {optimizer} needs megatron-core >= 0.19 (installed: 0.16.1"
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=1)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


def test_muon_with_fp16_refused_in_one_line(capsys):
    """megatron-core refuses fp16 for its emerging optimizers when it builds them; here at parse
    time, before any process group starts."""
    if not _muon_supported():
        pytest.skip("megatron-core < 0.19 has no Muon (test_muon_refused_without_megatron_core_muon)")
    pytest.importorskip("emerging_optimizers")
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(TINY + ["--optimizer", "muon", "--fp16", "--train-iters", "4"], world_size=1)
    err = capsys.readouterr().err
    assert "--optimizer muon does not support --fp16" in err and "Traceback" not in err
