"""Which GPU a stage process takes (no GPU needed: the choice is plain arithmetic)."""

from specpipe.worker.stage_main import cuda_index


def test_local_spawn_uses_rank_minus_one():
    # The driver spawns ranks 1..S on its own machine, with no LOCAL_RANK: GPUs 0..S-1.
    assert [cuda_index(r, 4, None) for r in (1, 2, 3, 4)] == [0, 1, 2, 3]
    assert [cuda_index(r, 2, None) for r in (1, 2, 3)] == [0, 1, 0]  # more stages than GPUs


def test_torchrun_uses_local_rank():
    # docs/cluster.md's torchrun example: driver (LOCAL_RANK 0) and stage 1 (LOCAL_RANK 1) on the first, stage 2
    # alone on the second with LOCAL_RANK 0: it must take that machine's GPU 0, not -1.
    assert cuda_index(1, 2, "1") == 1
    assert cuda_index(2, 1, "0") == 0
    assert cuda_index(3, 2, "3") == 1  # wraps around the machine's GPUs
