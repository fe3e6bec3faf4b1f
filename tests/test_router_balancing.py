"""Several router load-balancing losses at once, as Megatron-LM takes them:
``--moe-router-load-balancing-type seq_aux_loss global_aux_loss --moe-aux-loss-coeff 1e-3 1e-4``
(megatron-core adds each loss with its coefficient and logs each); one value each stays the
plain form; a coefficient count that does not match is refused in one line."""

import re

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import TINY, run_pretrain_steps

TWO = ["--moe-router-load-balancing-type", "seq_aux_loss", "global_aux_loss",
       "--moe-aux-loss-coeff", "1e-3", "1e-4"]


def _values(text, name):
    return [float(v) for v in re.findall(rf"\| {name}: (\S+) \|", text)]


def test_two_balancing_losses_train_and_log_each():
    base = [a for a in TINY if a not in ("--moe-aux-loss-coeff", "0.01")] + ["--train-iters", "2"]
    seq, two = run_distributed(run_pretrain_steps, 1, [   # seq first: megatron-core's loss
        {"argv": base + ["--moe-router-load-balancing-type", "seq_aux_loss",   # tracker is global
                         "--moe-aux-loss-coeff", "1e-3"]},
        {"argv": base + TWO},
    ], timeout_s=300)[0]
    assert two["exit"] == 0 and seq["exit"] == 0, (two["text"][-2000:], seq["text"][-2000:])
    for name in ("seq_load_balancing_loss", "global_load_balancing_loss"):
        values = _values(two["text"], name)
        assert len(values) == 2 and all(v > 0 for v in values), (name, two["text"][-2000:])
    assert _values(seq["text"], "global_load_balancing_loss") == []
    # the same seq loss with and without the global one beside it (same data and weights)
    assert _values(two["text"], "seq_load_balancing_loss")[0] == \
        _values(seq["text"], "seq_load_balancing_loss")[0]
    assert "load_balancing_loss: " not in two["text"].replace("_load_balancing_loss: ", "")


@pytest.mark.parametrize("extra,needle", [
    (["--moe-router-load-balancing-type", "seq_aux_loss", "global_aux_loss",
      "--moe-aux-loss-coeff", "1e-3"],
     "--moe-aux-loss-coeff needs one value per --moe-router-load-balancing-type (2: seq_aux_loss "
     "global_aux_loss), got 0.001"),
])
def test_mismatched_coefficients_refused_in_one_line(extra, needle, capsys):
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(TINY + ["--train-iters", "1"] + extra)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def _qb_betas(rank, world, runs):
    """Per run: every router's quantile-balancing bias (megatron-core's ``qb_beta``) after each
    iteration, read by the test."""
    from megatron.core import parallel_state

    from tests._train_cases import pretrain_recording

    def betas(trainer):
        return [m.qb_beta.tolist() for chunk in trainer.model for m in chunk.modules()
                if getattr(m, "qb_beta", None) is not None]

    out = []
    for argv in runs:
        parallel_state.destroy_model_parallel()
        out.append(pretrain_recording(argv, betas))
    return out


def test_quantile_balancing_updates_its_bias_with_the_ema(capsys):
    """megatron-core 0.19's quantile balancing: each router's per-expert bias moves every global
    batch (megatron-core's finalize_model_grads); --moe-router-quantile-balancing-ema 0.75 keeps
    0.75 of the previous bias, so after the first batch (same routing, from a zero bias) it is a
    quarter of the EMA-free one. megatron-core 0.16 has no quantile balancing: one line."""
    from megatron_moe.compat.versions import mcore_at_least

    base = [a for a in TINY if a not in ("--moe-aux-loss-coeff", "0.01")] + [
        "--train-iters", "3", "--moe-router-load-balancing-type", "quantile_balancing"]
    if not mcore_at_least("0.19"):
        from megatron_moe.arguments import parse_args

        with pytest.raises(SystemExit):
            parse_args(base)
        assert "--moe-router-load-balancing-type quantile_balancing needs megatron-core >= 0.19" \
            in capsys.readouterr().err
        return
    plain, ema = run_distributed(_qb_betas, 1, [
        base, base + ["--moe-router-quantile-balancing-ema", "0.75"]], timeout_s=300)[0]
    assert len(plain) == 3 and len(plain[0]) == 2          # 3 iterations x 2 MoE layers
    assert any(abs(v) > 0 for layer in plain[0] for v in layer)
    assert plain[1] != plain[0] and plain[2] != plain[1]   # updated every global batch
    for p, e in zip(plain[0], ema[0]):
        assert e == pytest.approx([0.25 * v for v in p], rel=1e-5, abs=1e-7)
