"""Spec-Bench prompts for the benchmark scripts; the loader lives in specpipe.bench.datasets."""

from specpipe.bench.datasets import GROUPS, data_file, load_prompts  # noqa: F401
