"""The averager is a forked process that runs torch ops on several executor threads at once."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from swarm.averager.process import rebuild_torch_thread_pool

FORKS, THREADS = 100, 8


def _first_ops_on_many_threads() -> int:
    """In a fresh fork: what the averager's executor does to its first parts, on THREADS threads at once."""
    errors = []

    def encode_like_a_codec() -> None:
        try:
            (torch.randn(64, 64) > 0).nonzero(as_tuple=True)
        except RuntimeError as e:  # "pool INTERNAL ASSERT FAILED ... Invalid thread pool!"
            errors.append(e)

    with ThreadPoolExecutor(THREADS) as pool:
        for _ in range(THREADS):
            pool.submit(encode_like_a_codec)
    return len(errors)


def test_a_forked_child_that_rebuilds_the_pool_first_never_loses_it():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as tests/engine_worker.py does before it starts a peer (and its averager)
    x = torch.randn(256, 256)
    (x @ x).nonzero()  # the parent has used its pool, as the trainer has before it starts the averager
    try:
        failed = sum(_fork_one() for _ in range(FORKS))
    finally:
        torch.set_num_threads(threads)
    # without the rebuild, about a quarter of these children lost a part here (56 of 200 in one measurement)
    assert failed == 0, f"{failed} of {FORKS} forked children lost torch's thread pool"


def _fork_one() -> bool:
    """True if the forked child failed."""
    pid = os.fork()
    if pid == 0:  # the child: exit at once with its verdict, never back into pytest
        code = 1
        try:
            rebuild_torch_thread_pool()
            code = 1 if _first_ops_on_many_threads() else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 0
