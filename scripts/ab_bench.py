#!/usr/bin/env python
"""A/B benchmark: stock SGLang vs superinfer_sgl, driven by SGLang's own load generator.

    python scripts/ab_bench.py --profile cpu            # SmolLM2 on CPU (calibrated)
    python scripts/ab_bench.py --profile smoke          # CI-sized
    python scripts/ab_bench.py --profile gpu --dry-run  # random-weight Llama-3-8B shape on a GPU
    python scripts/ab_bench.py --profile cpu --noise    # stock vs stock: run-to-run noise
    python scripts/ab_bench.py --profile cpu --capacity --paired --repeats 2   # SLO capacity per system

See docs/ab.md for what is measured and how; options: --help.
"""

import sys

from superinfer_sgl.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
