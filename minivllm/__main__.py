"`python -m minivllm ...`: the same command line as `minivllm ...` (hand-written; see nbs/15_cli.ipynb)."
import sys

from minivllm.cli import main

sys.exit(main())
