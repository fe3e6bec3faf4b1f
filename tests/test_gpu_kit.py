"""The GPU kit's parts that need no GPU run: the wheel selection (scripts/gpu_wheels.sh), the one
FLOP count (megatron_moe/flops.py), the planted offload fault that must fail the offload check
and the offload check's criterion (exact, then within rounding on a GPU)."""

import json
import os
import re
import subprocess
import sys
import types
import zipfile

import pytest

from megatron_moe.gpucheck import wheels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheels_are_the_runtime_dependencies_the_gpu_machine_lacks(tmp_path):
    deps = wheels.project_dependencies(os.path.join(ROOT, "pyproject.toml"))
    names = sorted(wheels.canonical(d.split(">")[0].split("<")[0].split("=")[0].strip())
                   for d in wheels.missing(deps))
    # pyproject's runtime dependencies minus the machine's list (flask: the text generation server;
    # tiktoken: TikTokenizer; threadpoolctl: the simulator's one BLAS thread; emerging-optimizers:
    # megatron-core's Muon on Python 3.12, the GPU machine's); scripts/gpu_wheels.sh then adds their
    # own requirements
    assert names == ["emerging-optimizers", "flask", "megatron-core", "packaging", "psutil",
                     "threadpoolctl", "tiktoken"]
    assert all("torch" not in n for n in names)
    w = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\n"
                   "Version: 1.0\nRequires-Dist: torch>=2.6.0\nRequires-Dist: packaging>=24.2\n"
                   "Requires-Dist: wandb; extra == \"dev\"\n"
                   "Requires-Dist: pywin32; sys_platform == \"win32\"\n"
                   "Requires-Dist: psutil; python_version >= \"3.12\"\n")
    reqs = wheels.wheel_requirements(str(w))
    # markers evaluated for the GPU machine (Python 3.12, Linux), whatever runs this, and removed:
    # pip download would evaluate them against its own interpreter
    assert reqs == ["torch>=2.6.0", "packaging>=24.2", "psutil"]
    assert wheels.missing(reqs) == ["packaging>=24.2", "psutil"]


def _args(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                ffn_hidden_size=256, vocab_size=1000, padded_vocab_size=1024, swiglu=False,
                num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None, moe_layer_freq=1,
                kv_channels=None, group_query_attention=False, num_query_groups=None,
                moe_shared_expert_intermediate_size=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_flops_match_megatron_formula_and_scale_with_topk():
    from megatron_moe.flops import num_floating_point_operations

    a = _args()
    B, s, L, h, V = 3, a.seq_length, a.num_layers, a.hidden_size, a.padded_vocab_size
    # Megatron-LM, dense GPT with ffn = 4h: 72 B s L h^2 (1 + s / (6h) + V / (12 h L))
    want = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert num_floating_point_operations(a, B) == pytest.approx(want, rel=1e-12)
    m1 = num_floating_point_operations(_args(num_experts=8, moe_router_topk=1,
                                             moe_ffn_hidden_size=256), B)
    m2 = num_floating_point_operations(_args(num_experts=8, moe_router_topk=2,
                                             moe_ffn_hidden_size=256), B)
    # one more routed expert per token: one more 2 x (h x f + f x h) forward, x3, per layer
    assert m2 - m1 == pytest.approx(3 * B * s * L * 2 * 2 * h * 256)


def test_theoretical_memory_tool_prints_the_same_flop_count(capsys):
    from megatron_moe.flops import num_floating_point_operations
    from tools import report_theoretical_memory as rtm

    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 "
            "--num-experts 4 --moe-router-topk 2 --vocab-size 1000 --world-size 1").split()
    args, _ = rtm.parse(argv)
    r = rtm.report(args)
    assert r["flops_per_iteration"] == num_floating_point_operations(args, 4)
    assert f"{r['flops_per_iteration'] / 1e12:.3f} TFLOP" in capsys.readouterr().out


def test_planted_skipped_bind_fails_the_offload_check(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1",
               MEGATRON_MOE_GPU_CHECK_PLANT="skip-bind")
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--cpu",
                        str(tmp_path), "--sections", "offload"], capture_output=True, text=True,
                       env=env, timeout=900, cwd=ROOT)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    assert "gpu-check offload: FAIL" in p.stdout
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    figures = report["checks"][0]["figures"]
    host = figures["host"]
    assert report["planted"] == "skip-bind" and figures["planted"]["skips"] == 1
    assert figures["planted"]["detected"]
    # caught either by the arena probe (a parameter outside the slots) or because the skipped
    # layer computed on its poison placeholder (NaN or zero-element: the run stops)
    assert host["error"] or host["probe"]["violations"] > 0, host


# --- the performance section (megatron_moe/gpucheck/perf.py) ------------------------------------
def test_perf_wheels_are_pinned_and_not_followed(tmp_path, monkeypatch):
    """torchtitan travels pinned (the version the row names) with exactly the packages the row
    imports: its own Requires-Dist (its data stack) is not followed."""
    from megatron_moe.gpucheck import perf

    assert f"torchtitan=={perf.TORCHTITAN}" in wheels.PERF_WHEELS
    assert all("==" in r for r in wheels.PERF_WHEELS)
    fetched = []

    def fake_download(req, dest, python=None):
        name = req.split("==")[0].replace("-", "_")
        path = os.path.join(dest, f"{name}-1.0-py3-none-any.whl")
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"{name}-1.0.dist-info/METADATA", f"Name: {name}\nVersion: 1.0\n"
                       "Requires-Dist: datasets>=3.6\nRequires-Dist: wandb\n")
        fetched.append(req)
        return path
    monkeypatch.setattr(wheels, "pip_download", fake_download)
    monkeypatch.setattr(wheels, "project_dependencies", lambda path: [])
    got = wheels.fetch(ROOT, str(tmp_path), log=lambda *a: None)
    assert fetched == list(wheels.PERF_WHEELS) and len(got) == len(wheels.PERF_WHEELS)


@pytest.mark.parametrize("mutate", [False, True])
def test_perf_row_trains_the_shapes_model(mutate, monkeypatch):
    """A row in process (transformers' Mixtral, toy size): it trains, is measured and profiled,
    and its parameter count equals the shape's, which the section's verdict checks. Mutation: the
    row builds a model with a wider expert FFN; the verdict must catch it."""
    import transformers

    from megatron_moe.gpucheck import perf

    if mutate:
        real = transformers.MixtralConfig

        def wider(**kw):
            kw["intermediate_size"] += 8
            return real(**kw)
        monkeypatch.setattr(transformers, "MixtralConfig", wider)
    row = perf.run_row("transformers", "mixtral", "cpu")
    n = perf.ITERS["cpu"]
    # and one more under cProfile: the host time by package (the row's own, transformers, too)
    assert len(row["losses"]) == n["warmup"] + n["timed"] + n["profiled"] + perf.Meter.HOST_PROFILED
    assert row["host_by_package_s"].get("transformers", 0) > 0 and row["host_s_per_iter"] > 0
    assert len(row["iter_s_all"]) == n["timed"] and row["iter_s"] > 0
    assert row["aten_ops_per_iter"] > 0 and row["host_reads_per_iter"] >= 0
    ok, summary, figures, skipped = perf.verdict("mixtral", "cpu", {"transformers": row}, None)
    assert figures["rows"]["transformers"]["tokens_per_s"] > 0
    assert figures["flops_per_iter"] > 0 and skipped
    if mutate:
        assert not ok and not row["same_model"] and "parameters, the shape has" in summary
    else:
        assert ok and row["same_model"] and row["params"] == perf.expected_params(
            perf.SHAPES["mixtral"]["cpu"]), summary


def test_perf_failing_row_reports_and_the_others_run(tmp_path, monkeypatch):
    """Each row is its own process with a time limit: a row that runs out of time is reported
    with why, the next row still runs, and the shape's check fails."""
    import time

    from megatron_moe.gpucheck import perf

    monkeypatch.setitem(perf.ROW_CAP_S, "stock", (1, 1))
    # the stock row outlasts its cap (a CPU-mode row is a fork of this process: it runs the
    # patched function; at toy size the real row can finish inside the second)
    run_row = perf.run_row
    monkeypatch.setattr(perf, "run_row", lambda system, *a, **k: (
        time.sleep(60) if system == "stock" else None) or run_row(system, *a, **k))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    with open(tmp_path / "log", "w") as log:
        data = perf.run_section(True, str(tmp_path), log, 600, shapes=["mixtral"],
                                systems=["stock", "transformers"])
    (check,) = data["checks"]
    rows = check["figures"]["rows"]
    assert check["status"] == "FAIL" and "timed out after 1s" in rows["stock"]["error"]
    assert rows["transformers"]["same_model"] and rows["transformers"]["tokens_per_s"] > 0
    assert "stock: no result: timed out after 1s" in check["summary"]
    perf.write_reports(str(tmp_path), data["checks"], "cpu")
    md = (tmp_path / "perf_report.md").read_text()
    assert "| stock | FAILED: no result: timed out after 1s |" in md
    assert "| transformers |" in md and "say nothing about GPU speed" in md


# --- torchtitan 0.3.0 on the GPU machine's torch 2.11 (megatron_moe/compat/torchtitan.py) --------
def test_fsdp_mesh_dims_stand_in_only_where_torch_lacks_the_class(monkeypatch):
    """Where torch has no DataParallelMeshDims the bridge registers a stand-in that refuses to be
    built (torchtitan builds one only for multi-rank FSDP, which the row never runs); where torch
    has the class it is left alone."""
    import torch
    import torch.distributed.fsdp as fsdp

    from megatron_moe.compat import torchtitan as bridge

    monkeypatch.delattr(fsdp, "DataParallelMeshDims", raising=False)
    assert bridge.bridge_fsdp_mesh_dims() is True
    from torch.distributed.fsdp import DataParallelMeshDims

    with pytest.raises(RuntimeError, match=re.escape(
            f"torch {torch.__version__} has no torch.distributed.fsdp.DataParallelMeshDims")):
        DataParallelMeshDims(shard="dp_shard")
    assert bridge.bridge_fsdp_mesh_dims() is True    # idempotent: still the stand-in

    class Real:   # a torch that has the class (2.13)
        pass
    monkeypatch.setattr(fsdp, "DataParallelMeshDims", Real)
    assert bridge.bridge_fsdp_mesh_dims() is False and fsdp.DataParallelMeshDims is Real


TITAN_IMPORT = """
import sys
import torch.distributed.fsdp as fsdp
if hasattr(fsdp, "DataParallelMeshDims"):   # as on torch 2.11, the GPU machine's
    del fsdp.DataParallelMeshDims
if sys.argv[1] == "bridge":
    from megatron_moe.compat.torchtitan import bridge_fsdp_mesh_dims
    assert bridge_fsdp_mesh_dims()
from torchtitan.models.qwen3 import _build_qwen3_moe_layers, parallelize_qwen3
print("imported", parallelize_qwen3.__module__)
"""


@pytest.mark.parametrize("bridge", [True, False])
def test_torchtitan_imports_on_a_torch_without_fsdp_mesh_dims(bridge):
    """The GPU machine's failure (torch 2.11: ``cannot import name 'DataParallelMeshDims'`` from
    torchtitan/distributed/fsdp.py) reproduced on any torch by removing the class; with the bridge
    the row's torchtitan modules import. Mutation: without the bridge the import fails."""
    import importlib.util

    from megatron_moe.gpucheck import perf

    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip(f"torchtitan is not installed here (the kit carries torchtitan=="
                    f"{perf.TORCHTITAN}: pip install --no-deps --target DIR the PERF_WHEELS of "
                    "megatron_moe/gpucheck/wheels.py and put DIR on PYTHONPATH)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", TITAN_IMPORT, "bridge" if bridge else "none"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    if bridge:
        assert p.returncode == 0 and "imported torchtitan.models.qwen3.parallelize" in p.stdout, \
            p.stderr[-3000:]
    else:
        assert p.returncode != 0
        assert "cannot import name 'DataParallelMeshDims'" in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("case", ["graph_fails_eager_runs", "both_fail", "cpu"])
def test_torchtitan_row_runs_eager_once_more_when_its_cuda_graph_run_fails(case, tmp_path,
                                                                           monkeypatch):
    """On the GPU the torchtitan row runs with its default CUDA graph; if that row fails the
    runner runs it once more eager (its training.disable_cuda_graphs) and reports why. Other rows
    and the CPU mode are never run twice; a failing retry keeps both errors."""
    import io

    from megatron_moe.gpucheck import perf

    cpu = case == "cpu"
    s = perf.SHAPES["mixtral"]["cpu" if cpu else "gpu"]
    calls = []

    def fake_row(system, shape, cpu_, result, log, limit_s, eager=False):
        calls.append((system, eager))
        if system == "torchtitan" and not eager or case == "both_fail":
            return dict(error=f"{system}: RuntimeError: operation not permitted when stream is "
                              "capturing", wall_s=1.0, ended="ok")
        return dict(params=perf.expected_params(s), how=f"{system} row", losses=[2.0, 1.0],
                    iter_s=0.5, iter_s_all=[0.5], wall_s=1.0, ended="ok")
    monkeypatch.setattr(perf, "_row_process", fake_row)
    data = perf.run_section(cpu, str(tmp_path), io.StringIO(), 540, shapes=["mixtral"],
                            systems=["ours", "torchtitan"])
    (check,) = data["checks"]
    titan = check["figures"]["rows"]["torchtitan"]
    if case == "cpu":
        assert calls == [("ours", False), ("torchtitan", False)] and check["status"] == "FAIL"
        assert "eager retry" not in titan["error"]
    elif case == "both_fail":
        assert calls == [("ours", False), ("torchtitan", False), ("torchtitan", True)]
        assert check["status"] == "FAIL" and "| eager retry: torchtitan: Runtime" in titan["error"]
    else:
        assert calls == [("ours", False), ("torchtitan", False), ("torchtitan", True)]
        assert check["status"] == "PASS" and titan["same_model"], check["summary"]
        assert "stream is capturing" in titan["cuda_graph_error"]
        assert "ran eager because its default CUDA graph run failed" in titan["how"]
        assert "torchtitan (eager: its CUDA graph run failed)" in check["summary"]
        assert check["figures"]["ratios"]["ours/torchtitan"] == 1.0


def _offload_run(losses, grad_norms, layer_grads=None, weights=None):
    """An offload check run as train() returns it (history, probe counts, ExpertTrace records)."""
    import torch

    n = len(losses)
    layer_grads = layer_grads or [[0.2, 0.18] for _ in range(n)]
    weights = weights or [[torch.zeros(4), torch.zeros(4)] for _ in range(n + 1)]
    return dict(error=None, history=dict(lm_loss=list(losses), grad_norm=list(grad_norms)),
                probe=dict(calls=16, violations=0),
                trace=dict(grad_norms=[list(g) for g in layer_grads], weights=weights))


# the 2026-11-29 H200 offload section's host (bf16) run against its resident run: bit-equal
# through iteration 2, rounding drift after (the host's CPU Adam against the device's fused Adam)
RESIDENT_LOSS = [10.460680484771729, 10.478338241577148, 10.378083229064941, 10.326595306396484,
                 10.173954486846924, 10.043919086456299]
HOST_LOSS = [10.460680484771729, 10.478338241577148, 10.378096580505371, 10.327138423919678,
             10.171911239624023, 10.043287754058838]
RESIDENT_GN = [2.9488006093273476, 2.913282192779413, 2.213122578759365, 1.7825894589867772,
               1.7227871730471302, 1.0083862564027986]
HOST_GN = [2.9488006093273476, 2.913282192779413, 2.214084609519603, 1.7892992287814238,
           1.7128501200046236, 1.032226677987517]


def _drifted_layers(n, scale):
    return [[0.2, 0.18] if it < 2 else [0.2 * (1 + scale), 0.18 * (1 - scale)] for it in range(n)]


def _drifted_weights(n):
    import torch

    return [[torch.zeros(4), torch.zeros(4)] if it < 2 else
            [torch.full((4,), 1.5e-5), torch.zeros(4)] for it in range(n + 1)]


def test_offload_criterion_accepts_rounding_drift_and_fails_a_lost_gradient():
    """The offload check's criterion on the GPU (bf16 tolerance): the H200 run's rounding drift
    passes; the first H200 run's bug (DDP's grad hook lost: grad norm 23% low from iteration 2,
    the experts' grads zero) fails, and so does the same loss of gradients from iteration 4
    (past the exact iterations, caught by the tolerance on the layers' expert grad norms and the
    grad norm). On the CPU (same Adam arithmetic in both runs) the rounding drift itself fails."""
    from megatron_moe.gpucheck.checks import offload_criterion, offload_verdict

    gpu = offload_criterion("gpu", "bf16")
    assert gpu["exact_iters"] == 2
    resident = _offload_run(RESIDENT_LOSS, RESIDENT_GN)
    host = _offload_run(HOST_LOSS, HOST_GN, _drifted_layers(6, 1e-3), _drifted_weights(6))
    ok, why = offload_verdict(host, resident, gpu)
    assert ok, why
    assert "bit-equal through iteration 2" in why and "grad norm 0.024" in why

    # the old bug: from iteration 2 the experts' grads never reach DDP's buffer
    lost_gn = RESIDENT_GN[:1] + [g * 0.77 for g in RESIDENT_GN[1:]]
    lost_layers = [[0.2, 0.18]] + [[0.0, 0.0]] * 5
    bug = _offload_run(RESIDENT_LOSS[:3] + [x + 0.01 for x in RESIDENT_LOSS[3:]], lost_gn,
                       lost_layers)
    ok, why = offload_verdict(bug, resident, gpu)
    assert not ok and "iteration 2 (exact) grad norm, expert grads differ" in why, why

    # the same loss of gradients appearing only after the exact iterations
    late_gn = RESIDENT_GN[:3] + [g * 0.77 for g in RESIDENT_GN[3:]]
    late_layers = [[0.2, 0.18]] * 3 + [[0.0, 0.0]] * 3
    late = _offload_run(RESIDENT_LOSS, late_gn, late_layers)
    ok, why = offload_verdict(late, resident, gpu)
    assert not ok and "grad norm rel diff 0.23 > 0.05" in why and "layer grad rel diff 1" in why

    # the CPU demands bit-equality in every iteration: the same drift fails there
    ok, why = offload_verdict(host, resident, offload_criterion("cpu", "bf16"))
    assert not ok and "iteration 3 (exact) loss, grad norm, expert grads, expert weights" in why

    # fp32 (the ssd tier's comparison): its rounding level passes, the bf16 drift does not
    fp32 = offload_criterion("gpu", "fp32")
    ssd = _offload_run(RESIDENT_LOSS, [g * (1 + 4e-7) if i >= 2 else g
                                       for i, g in enumerate(RESIDENT_GN)])
    assert offload_verdict(ssd, resident, fp32)[0]
    assert not offload_verdict(host, resident, fp32)[0]


def test_offload_criterion_fails_a_crash_and_an_unprobed_run():
    from megatron_moe.gpucheck.checks import offload_criterion, offload_verdict

    gpu = offload_criterion("gpu", "bf16")
    resident = _offload_run(RESIDENT_LOSS, RESIDENT_GN)
    assert offload_verdict(dict(error="NaN loss"), resident, gpu) == (False, "crashed (NaN loss)")
    outside = _offload_run(RESIDENT_LOSS, RESIDENT_GN)
    outside["probe"] = dict(calls=16, violations=1)
    ok, why = offload_verdict(outside, resident, gpu)
    assert not ok and "1 outside the arena" in why
    assert offload_verdict(_offload_run(RESIDENT_LOSS, RESIDENT_GN), resident, gpu)[0]


def test_offload_criterion_fails_a_nan_past_the_exact_iterations():
    from megatron_moe.gpucheck.checks import offload_criterion, offload_verdict

    resident = _offload_run(RESIDENT_LOSS, RESIDENT_GN)
    nan = _offload_run(RESIDENT_LOSS, RESIDENT_GN[:4] + [float("nan")] * 2)
    ok, why = offload_verdict(nan, resident, offload_criterion("gpu", "bf16"))
    assert not ok and "grad norm rel diff inf > 0.05" in why, why


# the H200's Mixtral-like rows, 2026-11-29 (docs/gpu_runs/2026-11-29-h200/perf-4-microbatches)
H200_OURS = [10.7798, 10.7798, 9.5177, 9.067, 8.4691, 7.3447, 6.0488, 4.8412, 3.8368]
H200_GRAPHED = [10.7798, 10.7798, 9.5162, 9.0619, 8.4644, 7.2599, 6.0375, 4.798, 3.7743]


@pytest.mark.parametrize("case", ["h200", "no_training_replays", "eager_differs",
                                  "first_replay_off"])
def test_graphed_row_losses_must_follow_ours(case):
    """The graphed row proves its replays trained by its losses: equal to ours' in the eager
    iterations, close at the first replay, within bf16 drift after (the H200's figures pass);
    replays that leave the loss where the capture found it, an eager iteration that differs, or a
    first replay far off fail the shape's check."""
    from megatron_moe.gpucheck import perf

    s = perf.SHAPES["mixtral"]["gpu"]
    graphed = list(H200_GRAPHED)
    if case == "no_training_replays":
        graphed[perf.GRAPH_WARMUP + 1:] = [graphed[perf.GRAPH_WARMUP]] * (
            len(graphed) - perf.GRAPH_WARMUP - 1)
    elif case == "eager_differs":
        graphed[1] += 1e-4
    elif case == "first_replay_off":
        graphed[perf.GRAPH_WARMUP] *= 1.01

    def row(losses):
        return dict(params=perf.expected_params(s), losses=losses, iter_s=0.6, iter_s_all=[0.6])
    ok, summary, figures, _ = perf.verdict(
        "mixtral", "gpu", {"ours": row(H200_OURS), "ours-graphed": row(graphed)}, 989.0)
    if case == "h200":
        assert ok and "ours-graphed: losses differ" not in summary, summary
        assert figures["rows"]["ours-graphed"]["max_rel_loss_diff_vs_ours"] > 1e-2
    else:
        assert not ok and "ours-graphed: losses differ from ours'" in summary, summary
