"""Run pretrain() on 2 gloo ranks with the given flags and print rank 0's history as JSON.

Used by tests/test_compat_checkpoint.py to train under another venv's interpreter (another
megatron-core release):  python tests/_xver_train.py '["--num-layers", "2", ...]'
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    import megatron.core

    from megatron_moe.runtime.local_ranks import run_distributed
    from tests._train_cases import run_pretrain

    argv = json.loads(sys.argv[1])
    history = run_distributed(run_pretrain, 2, argv, timeout_s=300)[0]
    print(json.dumps({"megatron_core": megatron.core.__version__, "history": history}))


if __name__ == "__main__":
    main()
