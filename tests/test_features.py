"""The feature protocol (megatron_moe/features.py): one list wires every feature's flags, checks,
declared exclusions, spec edit and run hooks."""

import copy

import pytest

from megatron_moe import arguments, balance, features, offload
from megatron_moe.models import embedding
from megatron_moe.flags.exclusions import Exclusion

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--lr 1e-3 --train-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 256 "
        "--num-experts 4 --disable-bias-linear").split()
ON = {balance: ["--moe-balance-policy", "proprophet"], offload: ["--moe-expert-offload", "host"],
      embedding: ["--embedding-partition", "hidden", "--untie-embeddings-and-output-weights"]}
DECLARED = [(f, ex) for f in ON for ex in f.EXCLUDES]


def _parsed(feature):
    return arguments.parse_args(BASE + ON[feature], world_size=1, check_data_paths=False)


# settings that violate an exclusion beyond "the flag is set"
VIOLATIONS = {"--moe-grouped-gemm": dict(moe_grouped_gemm=True, transformer_impl="transformer_engine"),
              "--moe-balance-policy": dict(moe_balance_policy="proprophet"),
              "--recompute-modules": dict(recompute_modules=["moe"], recompute_granularity="selective")}


def _violate(args, ex: Exclusion):
    dest = ex.flag.lstrip("-").replace("-", "_")
    for key, value in VIOLATIONS.get(ex.flag, {dest: 2 if ex.needs_one else 8}).items():
        setattr(args, key, value)


@pytest.mark.parametrize("feature,ex", DECLARED, ids=[f"{features.name(f)}{e.flag}" for f, e in DECLARED])
def test_every_declared_exclusion_is_refused(feature, ex):
    args = _parsed(feature)
    features.validate_args(copy.deepcopy(args))  # the feature alone is valid
    _violate(args, ex)
    with pytest.raises(ValueError) as err:
        features.validate_args(args)
    message = str(err.value)
    assert message.startswith(feature.setting(args)) and ex.flag in message, message


def test_exclusion_refused_at_parse_time_with_one_line(capsys):
    with pytest.raises(SystemExit) as err:
        arguments.parse_args(BASE + ON[balance] + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                             world_size=2, check_data_paths=False)
    assert err.value.code == 2
    line = capsys.readouterr().err.splitlines()[0]
    assert "--moe-balance-policy proprophet needs --tensor-model-parallel-size 1 (got 2)" in line


def test_exclusions_are_the_check(monkeypatch):
    """Mutation: without the declared table the same combination passes validation."""
    args = _parsed(balance)
    args.tensor_model_parallel_size = 2
    monkeypatch.setattr(balance, "EXCLUDES", ())
    features.validate_args(args)  # no refusal left anywhere else


def test_inactive_feature_refuses_nothing():
    args = arguments.parse_args(BASE + ["--use-distributed-optimizer"], world_size=1,
                                check_data_paths=False)
    assert offload.setting(args) is None and balance.setting(args) is None
    features.validate_args(args)


class _Recorder:
    def __init__(self, log, key):
        self.log, self.key = log, key

    def after_step(self, iteration):
        self.log.append((self.key, "after_step", iteration))

    def state_dict(self):
        return {"k": self.key}

    def load_state_dict(self, state):
        self.log.append((self.key, "load", state["k"]))

    def log_line(self):
        return f"[{self.key}] line"


def test_run_hooks_call_every_feature_in_order_and_key_state_by_name():
    log = []

    class Fake:
        def __init__(self, key):
            self.__name__ = f"megatron_moe.fake.{key}"
            self.key = key

        def run_hooks(self, args, model, optimizer, tracker):
            return _Recorder(log, self.key)

    class Off:
        __name__ = "megatron_moe.fake.off"

        @staticmethod
        def run_hooks(args, model, optimizer, tracker):
            return None

    hooks = features.RunHooks(None, [], features=(Fake("a"), Off, Fake("b")))
    hooks.after_step(7)
    assert log == [("a", "after_step", 7), ("b", "after_step", 7)]
    assert hooks.state_dict() == {"a": {"k": "a"}, "b": {"k": "b"}}
    hooks.load_state_dict({"b": {"k": "b"}})
    assert log[-1] == ("b", "load", "b") and len(log) == 3
    assert hooks.log_lines() == ["[a] line", "[b] line"]
