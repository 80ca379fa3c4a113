"""SpecPipe: pipeline-parallel LLM inference kept busy by a dynamic speculative token tree.

    from specpipe import LLM, SamplingParams
"""

__version__ = "0.1.0"

from specpipe import cpus as _cpus

# Before anything imports torch (whose OpenMP runtime reads it once, at load): idle OpenMP threads
# sleep instead of spinning on cores other processes need (specpipe/cpus.py).
_cpus.set_openmp_wait_policy()
_cpus.cap_openmp_threads()  # a cgroup CPU quota below the affinity mask: OpenMP's default would exceed it

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so that `specpipe --version` and the stage processes do not import the whole engine.
    if name == "LLM":
        from specpipe.engine.llm import LLM

        return LLM
    if name == "RequestOutput":
        from specpipe.outputs import RequestOutput

        return RequestOutput
    if name == "SamplingParams":
        from specpipe.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'specpipe' has no attribute {name!r}")
