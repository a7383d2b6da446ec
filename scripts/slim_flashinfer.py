#!/usr/bin/env python3
"""Slim FlashInfer so it can travel to the lent GPU machine: runs `python -m superinfer_sgl.flashinfer_slim`
(same options; see superinfer_sgl/flashinfer_slim/). Kept for the commands in the issue-34 notes."""
import sys

from superinfer_sgl.flashinfer_slim.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
