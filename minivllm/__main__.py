"`python -m minivllm ...`: the same command line as `minivllm ...` (hand-written; see nbs/12_llm.ipynb)."
import sys

from minivllm.llm import main

sys.exit(main())
