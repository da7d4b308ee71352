"""Issue 41's study: which layers of a decoder LM tolerate which low-precision formats, by block depth.

One command per figure, each writing results/<device>/block-study/ (--out) with its own section of summary.md:

    python benchmarks/block_study.py --part {sqnr,drop,search,horizon2,reprice,schedule,horizon} --out results/cpu-epyc-bf16-2core/block-study

One module a part, named after it, whose docstring says what the part runs and writes; `common` holds what every part
shares (the GPT-2 example, the formats, the paths, the figures, summary.md), `policies` the policies that the search
and the horizons compare, `runs` one (policy, seed) training run and its csv, `cli` the command line.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's autoprec, whatever the working directory
