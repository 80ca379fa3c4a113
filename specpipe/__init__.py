"""SpecPipe: pipeline-parallel LLM inference kept busy by a dynamic speculative token tree."""

__version__ = "0.1.0"
