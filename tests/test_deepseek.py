"""DeepSeek-V2/V3 on megatron-core's modules, trained on 2 CPU ranks.

A tiny DeepSeek-V3: MLA (q and kv LoRA, decoupled RoPE, YaRN with --mscale/--mscale-all-dim),
group-limited routing, sigmoid scores with the aux-loss-free expert bias, seq_aux_loss, a shared
expert, a dense first layer (--moe-layer-freq), Multi-Token Prediction. EP=2 with exact resume and
generation; TP=2 and PP=2. Then Megatron-LM's DeepSeek-V2-Lite configuration with only the sizes
overridden (examples/pretrain_deepseek_v2_lite_cpu.sh), under torchrun: trains, saves, resumes
exactly, generates. Bad combinations fail at parse time with one line.
"""

import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from megatron_moe.runtime.local_ranks import free_port, run_distributed, run_script
from tests._deepseek_cases import generate_and_recompute, train_capture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

V3 = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
      "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --mock-data "
      "--tokenizer-type NullTokenizer --vocab-size 256 --log-interval 1 --eval-interval 1000 "
      "--eval-iters 1 --disable-bias-linear --position-embedding-type rope --normalization RMSNorm "
      "--swiglu --untie-embeddings-and-output-weights "
      "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 "
      "--qk-pos-emb-head-dim 4 --v-head-dim 6 --kv-channels 8 --qk-layernorm "
      "--rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707 "
      "--num-experts 4 --moe-layer-freq ([0]+[1]*1) --moe-ffn-hidden-size 16 "
      "--moe-shared-expert-intermediate-size 16 --moe-router-topk 2 --moe-router-num-groups 2 "
      "--moe-router-group-topk 1 --moe-router-score-function sigmoid "
      "--moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5 "
      "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3 "
      "--moe-token-dispatcher-type alltoall --mtp-num-layers 1").split()

LOSS_LINE = re.compile(r"iteration\s+(\d+)/.*\| lm loss: (\S+) \| seq_load_balancing_loss: (\S+) "
                       r"\| mtp_1 loss: (\S+) \| loss scale:")


def _train(world, extra, **kw):
    out = run_distributed(train_capture, world, V3 + extra.split(), timeout_s=300, **kw)
    return out[-1]   # the last rank: the last pipeline stage prints the log line


EP2 = "--expert-model-parallel-size 2 --train-iters 4"


@pytest.fixture(scope="module")
def v3_ep2(tmp_path_factory):
    """The tiny DeepSeek-V3 at EP=2, 4 iterations, saved at 2 and 4: (history, printed, save dir)."""
    full_dir = str(tmp_path_factory.mktemp("v3") / "full")
    history, printed = _train(2, f"{EP2} --save {full_dir} --save-interval 2")
    return history, printed, full_dir


def test_v3_ep2_mtp_exact_resume_and_generation(v3_ep2, tmp_path):
    full, printed, full_dir = v3_ep2
    resumed_dir = str(tmp_path / "resumed")
    common = EP2
    # Megatron's log line: lm loss, the MoE aux loss, then 'mtp_1 loss' (MTPLossLoggingHelper)
    lines = [m.groups() for m in LOSS_LINE.finditer(printed)]
    assert [int(g[0]) for g in lines] == [1, 2, 3, 4], printed[-2000:]
    assert all(float(g[3]) > 0 for g in lines)
    losses = full["lm_loss"]
    assert losses[-1] < losses[0] - 0.1, losses
    # the MTP layer's MoE is a layer of its own in the expert-load lines (after the 2 decoder layers)
    assert " [moe] layer   3 |" in printed and " [moe] layer   1 |" not in printed
    # resume from iteration 2 (a copy: never write into the run it compares to)
    resumed, _ = _train(2, f"{common} --load {full_dir} --ckpt-step 2 --save {resumed_dir}")
    assert resumed["iteration"] == [3, 4]
    for key in ("lm_loss", "grad_norm", "lr"):
        assert resumed[key] == full[key][2:], key     # bit-identical, MTP included
    # generation ignores the MTP block; KV-cached greedy decoding == a full forward's argmax
    gen = run_distributed(generate_and_recompute, 1, ["--load", full_dir, "--use-checkpoint-args"],
                          "5 17 42 9", 6, timeout_s=240)[0]
    assert gen["iteration"] == 4 and not gen["has_mtp"]
    assert gen["core_attention"] == ["UnequalHeadDotProductAttention"]
    assert len(gen["generated"]) == 6
    assert gen["generated"] == gen["argmax"]
    assert gen["log_probs"] == pytest.approx(gen["recomputed"], abs=1e-4)
    # the aux-loss-free expert bias moved during training and came back from the checkpoint
    assert gen["expert_bias_max"] > 0


def test_v3_with_fused_permute_hierarchical_alltoall_and_offload_is_bit_identical(v3_ep2):
    """Our fused permute kernels, the hierarchical all-to-all (2 one-rank "nodes") and host expert
    offload (the MTP layer's experts too) are exact: the DeepSeek-V3 run (MTP, shared expert,
    group-limited biased sigmoid routing) is bit-identical."""
    full, _, _ = v3_ep2
    fused, printed = _train(2, f"{EP2} --moe-permute-fusion --moe-a2a-algorithm hierarchical "
                               "--ranks-per-node 1 --moe-expert-offload host "
                               "--moe-offload-debug-nan-fill")
    # the experts really lived on the host: the device held at most K=2 of the 2 MoE layers'
    # (decoder + MTP) expert bytes at a time, and the peak line says so every iteration
    peaks = re.findall(r"\[offload\] device expert bytes peak: (\d+) of (\d+) \| host: (\d+)",
                       printed)
    assert len(peaks) == 4 and all(int(h) > 0 for _, _, h in peaks), printed[-2000:]
    for key in ("lm_loss", "grad_norm"):
        assert fused[key] == full[key], key


def test_v3_with_balancing_and_topology_routing():
    """FasterMoE-style balancing (shadowed experts) and the topology-loss router (2 one-rank nodes)
    with MLA, the shared expert, the dense first layer and group-limited biased sigmoid routing
    (the balancer refuses MTP, see test_bad_combinations_fail_at_parse_time)."""
    assert V3[-2:] == ["--mtp-num-layers", "1"]
    no_mtp = V3[:-2]
    out = run_distributed(train_capture, 2, no_mtp + (
        f"{EP2} --moe-balance-policy fastermoe --moe-router-topology ta_loss "
        "--ranks-per-node 1").split(), timeout_s=300)
    history, printed = out[-1]
    losses = history["lm_loss"]
    assert all(l == l for l in losses) and losses[-1] < losses[0] - 0.1, losses
    # the topology router ran: its loss is in Megatron's log line next to the aux loss
    assert len(re.findall(r"\| topology_loss: \S+ \|", printed)) == 4, printed[-2000:]


@pytest.mark.parametrize("layout", [
    "--tensor-model-parallel-size 2 --sequence-parallel",
    "--pipeline-model-parallel-size 2",
], ids=["tp2", "pp2"])
def test_v3_tp2_and_pp2(layout):
    history, printed = _train(2, f"--train-iters 4 {layout}")
    losses = history["lm_loss"]
    assert all(l == l for l in losses) and losses[-1] < losses[0] - 0.1, losses
    assert len(LOSS_LINE.findall(printed)) == 4, printed[-2000:]


# --- Megatron-LM's DeepSeek-V2-Lite configuration, sizes overridden, under torchrun ----------------
SIZE_FLAGS = {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
              "--kv-channels", "--kv-lora-rank", "--v-head-dim", "--qk-head-dim",
              "--qk-pos-emb-head-dim", "--seq-length", "--max-position-embeddings",
              "--make-vocab-size-divisible-by", "--num-experts", "--moe-layer-freq",
              "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size"}
GPU_ONLY = {"--moe-grouped-gemm"}


def _array_flags(path, names=("MODEL_ARGS", "MOE_ARGS")):
    """{flag: value or None} of a launch script's model arrays."""
    text = open(path).read()
    flags = {}
    for name in names:
        words = shlex.split(re.search(rf"^{name}=\((.*?)\)$", text, re.S | re.M).group(1))
        for i, w in enumerate(words):
            if w.startswith("--"):
                nxt = words[i + 1] if i + 1 < len(words) else None
                flags[w] = None if nxt is None or nxt.startswith("--") else nxt
    return flags


def test_cpu_variant_is_v2_lite_with_only_sizes_overridden():
    gpu = _array_flags(os.path.join(ROOT, "examples", "pretrain_deepseek_v2_lite.sh"))
    cpu = _array_flags(os.path.join(ROOT, "examples", "pretrain_deepseek_v2_lite_cpu.sh"))
    assert set(gpu) - set(cpu) == GPU_ONLY
    assert set(cpu) == set(gpu) - GPU_ONLY
    changed = {f for f in cpu if cpu[f] != gpu[f]}
    assert changed and changed <= SIZE_FLAGS, changed
    # Megatron-LM's configuration (core_v0.16.1 DeepSeek-V2-Lite.sh): the architecture flags
    for flag, value in {"--multi-latent-attention": None, "--qk-layernorm": None,
                        "--rotary-scaling-factor": "40", "--mscale": "0.707",
                        "--mscale-all-dim": "0.707", "--moe-router-topk": "6",
                        "--moe-router-load-balancing-type": "seq_aux_loss",
                        "--moe-router-pre-softmax": None, "--kv-lora-rank": "512",
                        "--moe-layer-freq": "([0]+[1]*26)", "--num-experts": "64"}.items():
        assert flag in gpu and gpu[flag] == value, flag


def _run(cmd, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHON=sys.executable,
               MASTER_PORT=str(free_port()))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    assert proc.returncode == 0, (out[-3000:], err[-3000:])
    return out


def _log_lines(out):
    """{iteration: the line from 'lm loss' to 'grad norm'} (timestamps and timings vary)."""
    lines = {}
    for line in out.splitlines():
        m = re.search(r"iteration\s+(\d+)/.*?(\| lm loss: .*?grad norm: \S+ \|)", line)
        if m:
            lines[int(m.group(1))] = m.group(2)
    return lines


def test_v2_lite_cpu_example_trains_resumes_exactly_and_generates(tmp_path):
    script = os.path.join(ROOT, "examples", "pretrain_deepseek_v2_lite_cpu.sh")
    full_dir, resumed_dir = str(tmp_path / "full"), str(tmp_path / "resumed")
    full = _log_lines(_run(["bash", script, full_dir]))      # 6 iterations, saves at 3 and 6
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    lm = [float(re.search(r"lm loss: (\S+)", full[i]).group(1)) for i in (1, 6)]
    assert lm[1] < lm[0] - 0.2, full
    assert all("seq_load_balancing_loss" in line for line in full.values())
    resumed = _log_lines(_run(["bash", script, resumed_dir, "--load", full_dir, "--ckpt-step", "3"]))
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[i] == full[i] for i in (4, 5, 6)), (resumed, full)
    # tools/generate.py as __main__ in a process forked from the fork server (torch and
    # megatron-core already imported), not a fresh interpreter
    gen = run_script(os.path.join(ROOT, "tools", "generate.py"),
                     ["--load", full_dir, "--use-checkpoint-args", "--prompts", "11 12 13",
                      "--num-tokens-to-generate", "5"],
                     env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), timeout_s=300)
    assert gen.returncode == 0, (gen.stdout[-3000:], gen.stderr[-3000:])
    out = gen.stdout
    text = out.split("-" * 80)[1].strip()
    assert text.startswith("11 12 13") and len(text.split()) == 3 + 5, out[-2000:]


# --- bad input: one line at parse time, before any process group --------------------------------
@pytest.mark.parametrize("extra,message", [
    ("--num-query-groups 2", "--multi-latent-attention and --group-query-attention"),
    ("--position-embedding-type learned_absolute",
     "--mtp-num-layers needs --position-embedding-type rope or none"),
    ("--kv-lora-rank 0", "--kv-lora-rank must be >= 1"),
    ("--moe-router-score-function softmax", "invalid model configuration"),   # expert bias
    ("--moe-router-num-groups 3", "invalid model configuration"),
    ("--moe-balance-policy proprophet", "--moe-balance-policy proprophet cannot be combined with "
                                        "--mtp-num-layers"),
    ("--embedding-partition hidden --expert-model-parallel-size 2",
     "--embedding-partition hidden cannot be combined with --mtp-num-layers"),
], ids=["mla-gqa", "mtp-learned-pos", "kv-lora-0", "bias-softmax", "groups-3", "balance-mtp",
        "embedding-hidden-mtp"])
def test_bad_combinations_fail_at_parse_time(extra, message, capsys):
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(V3 + ["--train-iters", "1"] + extra.split(), world_size=2)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 2, err   # the error + the help hint


def test_yarn_needs_mla(capsys):
    from megatron_moe.arguments import parse_args

    plain = [a for a in V3 if a not in ("--multi-latent-attention",)]
    with pytest.raises(SystemExit):
        parse_args(plain + ["--train-iters", "1", "--rope-type", "yarn", "--mtp-num-layers", "1"],
                   world_size=1)
    assert "--rope-type yarn needs --multi-latent-attention" in capsys.readouterr().err
