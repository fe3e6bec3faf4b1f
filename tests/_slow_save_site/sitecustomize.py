"""Interpreter start of a job launched by a kill test (tests/_slow_save.py puts this directory on
its PYTHONPATH): with MEGATRON_MOE_TEST_SAVE_DELAY set, every checkpoint save is slowed."""

import os

if os.environ.get("MEGATRON_MOE_TEST_SAVE_DELAY"):
    from tests._slow_save import DELAY_ENV, install

    install(float(os.environ[DELAY_ENV]))
