"""The block study's command: which layers of a decoder LM tolerate which low-precision formats, by block depth.

    python benchmarks/block_study.py --part {sqnr,drop,search,horizon2,reprice,schedule,horizon} --out results/cpu-epyc-bf16-2core/block-study

Its code is the package beside this file, benchmarks/blockstudy/: one module a part (each module's docstring says what
its part runs and writes) and the small ones they share.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the package beside this file, however this file is loaded

from blockstudy.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
