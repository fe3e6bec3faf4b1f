"""A child module for tests/test_gpu_check.py's check of megatron_moe/gpucheck/process.py:
``main(argv)`` as the kit's sections and rows have one."""

import os
import subprocess
import sys
import time


def main(argv):
    what = argv[0]
    # preloaded: a fork of the runner has megatron-core before this module's first line runs
    print(f"pid {os.getpid()} parent {os.getppid()} group {os.getpgrp()} "
          f"megatron.core {'megatron.core' in sys.modules}")
    if what == "exit":
        return int(argv[1])
    if what == "raise":
        raise RuntimeError("the child failed")
    if what == "hang":   # a grandchild in the child's process group, then a hang
        grandchild = subprocess.Popen(["sleep", "300"])
        print(f"grandchild {grandchild.pid}")
        time.sleep(300)
    return 0
