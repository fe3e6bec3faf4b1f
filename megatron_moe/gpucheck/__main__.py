import sys

from megatron_moe.gpucheck.run import main

sys.exit(main())
