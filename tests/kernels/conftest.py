"""The kernel tests check that every thread count gives the same bits on matrices far smaller than
the size below which the library runs a call on one thread (2 MiB of weights x rows): here every
call takes the threads it is given, so the split paths are what these tests run."""

import pytest

from specpipe.kernels import native


@pytest.fixture(autouse=True)
def every_call_split_across_its_threads():
    if not native.available():
        yield
        return
    native.set_parallel_min_bytes(0)
    yield
    native.set_parallel_min_bytes(2 << 20)
