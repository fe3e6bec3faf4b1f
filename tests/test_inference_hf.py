"""Inference on checkpoints imported from Hugging Face, against transformers (no download):

* Padded vocabulary: a Mixtral with a vocabulary of 400 imports with Megatron's padding to 512
  rows (the padded rows copy the last real one). Sampling at temperature 1 never draws an id >=
  400 and every log prob (generation, prompt, the server's /completions echo) equals
  transformers' within 1e-3; with the mask switched off (mutation) ids >= 400 are drawn and the
  log probs are lower by up to ~0.3 nats.
* finish_reason: a generation that ends at EOD says "stop" (megatron-core keeps no EOD among the
  generated tokens, so looking for it said "length"), its text keeps its last real token.
* DeepSeek-V3 as published: YaRN rope_scaling imports as --rope-type yarn with its beta/mscale
  flags and gives transformers' logits within 1e-5 (fp32); plain RoPE on the HF side (mutation)
  misses by far more. Saved by transformers with num_nextn_predict_layers=1 and no MTP
  weights, it imports without MTP (one line says so; its export is what transformers saved,
  bit for bit); without that rule the import stops. --init-missing-mtp keeps the MTP layer,
  initialised as megatron-core does.
* The import's printed flag line carries --bf16 for a bf16 checkpoint.
"""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_moe.runtime.local_ranks import run_distributed
from tests._inference_hf_cases import generate_then_logits_case

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 400  # Megatron pads it to 512 rows
PROMPT = [5, 17, 230, 42, 399, 8, 101, 77]
N_TOKENS, SAMPLES = 24, 4
TOL = dict(rtol=1e-5, atol=1e-5)
TOKENS = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1)).tolist()
# DeepSeek-V3/R1's published rope_scaling (config.json on the Hub), as transformers reads it
PUBLISHED_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}
# transformers 5's own spelling, with every YaRN field away from its default
OTHER_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0,
              "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.7,
              "original_max_position_embeddings": 16}


def make_mixtral(path, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=48,
                                     num_hidden_layers=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64,
                                     rope_theta=10000.0, initializer_range=0.1)
    transformers.MixtralForCausalLM(cfg).to(dtype).save_pretrained(path)


def make_deepseek(path, rope):
    """A DeepSeek-V3 shaped as the real one (MLA with q/kv LoRA, a dense first layer, grouped
    sigmoid routing with expert bias, a shared expert, num_nextn_predict_layers=1: transformers'
    default, whose MTP weights transformers does not save), with YaRN ``rope``."""
    torch.manual_seed(0)
    published = "type" in rope
    cfg = transformers.DeepseekV3Config(
        vocab_size=250, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=80, moe_intermediate_size=16, num_hidden_layers=2, n_shared_experts=1,
        n_routed_experts=4, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, v_head_dim=6, qk_nope_head_dim=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
        rope_interleave=True, max_position_embeddings=163840 if published else 64,
        initializer_range=0.1,
        rope_parameters=dict({k: v for k, v in rope.items() if k != "type"}, rope_type="yarn",
                             rope_theta=10000.0))
    assert cfg.num_nextn_predict_layers == 1
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    if published:  # config.json as the Hub has it: rope_scaling with "type", rope_theta on top
        path_cfg = os.path.join(path, "config.json")
        saved = json.load(open(path_cfg))
        saved.pop("rope_parameters")
        saved.update(rope_scaling=dict(rope), rope_theta=10000.0)
        json.dump(saved, open(path_cfg, "w"))


def convert(*runs):
    code = ("import json, sys; sys.path.insert(0, 'tools/checkpoint'); import convert\n"
            "for argv in json.loads(sys.argv[1]): convert.main(argv)")
    argvs = [["--model-type", "GPT"] + list(r) for r in runs]
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def hf_model(path, **override):
    cfg = transformers.AutoConfig.from_pretrained(path)
    for key, value in override.items():
        setattr(cfg, key, value)
    return transformers.AutoModelForCausalLM.from_pretrained(path, config=cfg,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfinf")
    d = {k: str(root / k) for k in ("mixtral", "mixtral_meg", "bf16", "bf16_meg", "ds_published",
                                    "ds_published_meg", "ds_published_back", "ds_other",
                                    "ds_other_meg", "ds_mtp_meg", "ds_mtp_back")}
    make_mixtral(d["mixtral"])
    make_mixtral(d["bf16"], torch.bfloat16)
    make_deepseek(d["ds_published"], PUBLISHED_YARN)
    make_deepseek(d["ds_other"], OTHER_YARN)
    imports = [["--load-dir", d[k], "--save-dir", d[k + "_meg"]]
               for k in ("mixtral", "bf16", "ds_published", "ds_other")]
    imports.append(["--load-dir", d["ds_published"], "--save-dir", d["ds_mtp_meg"],
                    "--init-missing-mtp"])
    exports = [["--load-dir", d[k + "_meg"], "--save-dir", d[k + "_back"]]
               for k in ("ds_published", "ds_mtp")]
    log = convert(*[["--loader", "hf", "--saver", "megatron"] + r for r in imports],
                  *[["--loader", "megatron", "--saver", "hf"] + r for r in exports])
    jobs = [(d[k], d[k + "_meg"], [""], TOKENS) for k in ("ds_published", "ds_other")]
    # one process: the logits' plain forwards run after the engine has generated
    out = run_distributed(generate_then_logits_case, 1, d["mixtral_meg"], PROMPT, N_TOKENS,
                          SAMPLES, jobs, timeout_s=600)[0]
    return dict(d, log=log, out=out)


def _reference_log_probs(model, prompt, tokens):
    """transformers' log probs of prompt tokens 2..n and of ``tokens`` after the prompt."""
    seq = list(prompt) + list(tokens)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), dim=-1)
    return [float(logp[i - 1, seq[i]]) for i in range(1, len(seq))]


@pytest.mark.parametrize("mutate", [False, True], ids=["masked", "mutation-unmasked"])
def test_sampling_and_log_probs_exclude_padded_vocabulary(run, mutate):
    out = run["out"]
    assert (out["vocab"], out["padded_vocab"]) == (VOCAB, 512)
    model = hf_model(run["mixtral"])
    results = out["unmasked"] if mutate else out["sampled"]
    drawn = [t for r in results for t in r["tokens"]]
    assert len(drawn) > SAMPLES * N_TOKENS // 2  # really sampled (an EOD draw may end one early)
    padded = [t for t in drawn if t >= VOCAB]
    prompt_reference = _reference_log_probs(model, PROMPT, [])
    worst = 0.0
    for r in results:
        ours, reference = list(r["prompt_log_probs"]), prompt_reference
        if not any(t >= VOCAB for t in r["tokens"]):  # transformers has no such token
            ours += list(r["log_probs"])
            reference = _reference_log_probs(model, PROMPT, r["tokens"])
        assert len(ours) == len(reference)
        worst = max(worst, max(abs(a - b) for a, b in zip(ours, reference)))
    print(f"{'unmasked' if mutate else 'masked'}: {len(padded)} of {len(drawn)} sampled ids >= "
          f"{VOCAB}; max |log prob - transformers'| = {worst:.2e}")
    if mutate:  # the engine as it was: padded ids drawn, log probs off by far more than 1e-3
        assert padded and worst > 1e-2, (len(padded), worst)
        return
    assert not padded
    assert worst < 1e-3, worst
    # /completions echo (lm-evaluation-harness's loglikelihood): the same log probs
    echo = out["echo"]
    assert echo[0] is None
    torch.testing.assert_close(torch.tensor(echo[1:], dtype=torch.float64),
                               torch.tensor(_reference_log_probs(model, PROMPT, []),
                                            dtype=torch.float64),
                               rtol=0, atol=1e-3)


def test_finish_reason_stop_at_eod(run):
    greedy, ended = run["out"]["greedy"], run["out"]["ended"]
    assert greedy["finish_reason"] == "length" and len(greedy["tokens"]) == 8
    # generation stopped at the EOD: the tokens before it, no EOD among them, "stop"
    assert ended["tokens"] == greedy["tokens"][:ended["stop_at"]]
    assert ended["eod"] not in ended["tokens"]  # so the old rule (last token == eod) said "length"
    assert ended["finish_reason"] == ended["completion_finish"] == "stop"
    assert ended["completion"] == ended["expected_text"]  # its last real token is kept


@pytest.mark.parametrize("kind", ["ds_published", "ds_other"])
def test_deepseek_v3_yarn_logits_match_transformers(run, kind):
    index = ["ds_published", "ds_other"].index(kind)
    [(iteration, ours)] = run["out"]["logits"][index]
    reference = hf_model(run[kind])(torch.tensor(TOKENS)).logits.detach()
    assert reference.abs().max() > 0.5
    torch.testing.assert_close(ours, reference, **TOL)
    print(f"{kind}: max |ours - transformers| = {(ours - reference).abs().max():.2e}")
    # the YaRN really mattered: transformers with plain RoPE is far off
    plain = hf_model(run[kind], rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert (plain(torch.tensor(TOKENS)).logits - ours).abs().max() > 1e3 * TOL["atol"]
    # the stored args say YaRN with the config's values, and no MTP
    from megatron.core import dist_checkpointing

    stored = dist_checkpointing.load_common_state_dict(
        os.path.join(run[kind + "_meg"], "iter_0000000"))["args"]
    rope = PUBLISHED_YARN if kind == "ds_published" else OTHER_YARN
    assert stored.rope_type == "yarn" and stored.rotary_scaling_factor == rope["factor"]
    assert stored.yarn_original_max_position_embeddings == rope["original_max_position_embeddings"]
    assert (stored.yarn_beta_fast, stored.yarn_beta_slow) == (rope["beta_fast"], rope["beta_slow"])
    assert (stored.mscale, stored.mscale_all_dim) == (rope["mscale"], rope["mscale_all_dim"])
    assert stored.mtp_num_layers is None


def _flag_lines(log):
    """The printed flag lines of the imports: mixtral, bf16, ds_published, ds_other, ds_mtp."""
    lines = [line for line in log.splitlines() if line.startswith("model flags for")]
    assert len(lines) == 5
    return lines


def _hf_state(path):
    from safetensors.torch import load_file

    state = {}
    for shard in glob.glob(os.path.join(path, "*.safetensors")):
        state.update(load_file(shard))
    return state


def test_transformers_saved_deepseek_without_mtp_imports(run, monkeypatch):
    log = run["log"]
    assert log.count("holds no MTP weights") == 3
    assert log.count("imported without Multi-Token Prediction") == 2
    lines = _flag_lines(log)
    assert all("--mtp-num-layers" not in line for line in lines[2:4])
    # exported back: what transformers saved, bit for bit (no MTP tensors, config unchanged)
    original, back = _hf_state(run["ds_published"]), _hf_state(run["ds_published_back"])
    assert sorted(original) == sorted(back)
    assert all(torch.equal(original[k], back[k]) for k in original)
    assert json.load(open(os.path.join(run["ds_published_back"], "config.json"))) == \
        json.load(open(os.path.join(run["ds_published"], "config.json")))
    # mutation: without the rule the loader asks for the MTP layer transformers did not save
    sys.path.insert(0, os.path.join(ROOT, "tools", "checkpoint"))
    import argparse

    import loader_hf

    args = argparse.Namespace(load_dir=run["ds_published"], hf_config=None,
                              upcycle_num_experts=None, upcycle_topk=2, seed=1234,
                              init_missing_mtp=False)
    loader_hf.load_checkpoint(args)  # imports
    monkeypatch.setattr(loader_hf, "_unsaved_mtp", lambda cfg, *a: (cfg, False))
    with pytest.raises(SystemExit, match=r"tensor\(s\) missing.*model\.layers\.2\."):
        loader_hf.load_checkpoint(args)


def test_init_missing_mtp_initialises_the_mtp_layer(run):
    """--init-missing-mtp: --mtp-num-layers kept, the MTP layer made as megatron-core initialises
    (read back through an export, as the official checkpoint's model.layers.2.*)."""
    log = run["log"]
    assert log.count("1 MTP layer(s) initialised fresh (--init-missing-mtp, --seed)") == 1
    assert _flag_lines(log)[4].endswith("--mtp-num-layers 1")
    from megatron.core import dist_checkpointing

    stored = dist_checkpointing.load_common_state_dict(
        os.path.join(run["ds_mtp_meg"], "iter_0000000"))["args"]
    assert stored.mtp_num_layers == 1
    original, back = _hf_state(run["ds_published"]), _hf_state(run["ds_mtp_back"])
    assert all(torch.equal(original[k], back[k]) for k in original)  # the model itself untouched
    mtp = {k: v for k, v in back.items() if k.startswith("model.layers.2.")}
    assert set(mtp) == set(back) - set(original) and len(mtp) > 20
    std = 0.1  # initializer_range
    for name, t in mtp.items():
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        elif name.endswith("e_score_correction_bias"):
            assert torch.equal(t, torch.zeros_like(t)), name
        elif name.endswith("embed_tokens.weight"):
            assert torch.equal(t, original["model.embed_tokens.weight"])
        elif name.endswith("shared_head.head.weight"):
            assert torch.equal(t, original["lm_head.weight"])
        else:  # normal(0, std), output projections scaled by 1/sqrt(2 x 2 layers)
            scaled = name.endswith(("o_proj.weight", "down_proj.weight"))
            expected = std / 2 if scaled else std
            assert abs(t.std().item() - expected) < 0.35 * expected, (name, t.std().item())


def test_printed_flags_carry_the_dtype(run):
    lines = _flag_lines(run["log"])
    fp32, bf16 = lines[0], lines[1]
    assert bf16.endswith(" --bf16") and "--bf16" not in fp32 and "--fp16" not in fp32
    assert bf16[:-len(" --bf16")] == fp32  # the same model otherwise
    # and those flags build the stored model: its args say bf16 too
    from megatron.core import dist_checkpointing

    stored = dist_checkpointing.load_common_state_dict(
        os.path.join(run["bf16_meg"], "iter_0000000"))["args"]
    assert stored.bf16


def test_yarn_refusals_name_the_field():
    from megatron_moe.hf.families import FAMILIES, ConversionError

    base = dict(num_hidden_layers=1, hidden_size=8, num_attention_heads=1, vocab_size=8,
                qk_nope_head_dim=4, num_experts_per_tok=2, n_routed_experts=4,
                intermediate_size=8, moe_intermediate_size=4)
    ds = FAMILIES["deepseek_v3"]
    for rope, match in ((dict(PUBLISHED_YARN, truncate=False), "truncate=false"),
                        (dict(PUBLISHED_YARN, attention_factor=1.2), "attention_factor"),
                        (dict(PUBLISHED_YARN, mscale=0), "mscale_all_dim without mscale"),
                        ({"type": "longrope", "factor": 2}, "rope_type 'longrope'")):
        with pytest.raises(ConversionError, match=match):
            ds.spec_from_config(dict(base, rope_scaling=rope))


MLA_ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 64 --micro-batch-size 1 --train-iters 1 --lr 1e-3 "
            "--mock-data --tokenizer-type NullTokenizer --vocab-size 100 --swiglu "
            "--normalization RMSNorm --position-embedding-type rope --multi-latent-attention "
            "--kv-lora-rank 16 --qk-head-dim 8 --qk-pos-emb-head-dim 8 --v-head-dim 8 "
            "--rope-type yarn --rotary-scaling-factor 4").split()


@pytest.mark.parametrize("mutate", [False, True], ids=["flags-reach-mla", "mutation-dropped"])
def test_yarn_flags_reach_mla_config(monkeypatch, mutate):
    """--yarn-original-max-position-embeddings / --yarn-beta-fast / --yarn-beta-slow set
    MLATransformerConfig's fields (Megatron-LM leaves MLA at 4096 / 32 / 1)."""
    from megatron_moe.arguments import parse_args
    from megatron_moe.models import builder

    if mutate:
        monkeypatch.setattr(builder, "yarn_config_fields", lambda args: {})
    args = parse_args(MLA_ARGS + ["--yarn-original-max-position-embeddings", "16",
                                  "--yarn-beta-fast", "8", "--yarn-beta-slow", "2"], world_size=1)
    config = builder.transformer_config_from_args(args)
    fields = (config.original_max_position_embeddings, config.beta_fast, config.beta_slow)
    assert fields == ((4096, 32, 1) if mutate else (16, 8.0, 2.0))
    assert (config.rope_type, config.rotary_scaling_factor) == ("yarn", 4.0)


def test_mla_yarn_refuses_unrounded_correction_range(capsys):
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(MLA_ARGS + ["--no-yarn-correction-range-round-to-int"], world_size=1)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "always rounds the correction range" in err
