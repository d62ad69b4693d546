"""A DHT request whose sender left before the DHT process read it (``swarm.hivemind_fixes.requests``): dropped at
once, the DHT process alive and answering. Real DHT processes; the unreadable requests are made two ways: a
payload that fails to unpickle as a departed sender's reply pipe does (EOFError, which killed hivemind's DHT
process, and ConnectionRefusedError, which stalled it 3 s each), and real forked senders that exit at once."""

from __future__ import annotations

import multiprocessing as mp
import os

import hivemind
import pytest
from hivemind.utils import get_dht_time

from swarm.dht import calls
from swarm.hivemind_fixes.requests import tolerate_departed_senders

ORPHANS = 20  # unfixed, ConnectionRefusedError holds the DHT 3 s each: 60 s, past the get's timeout below
ANSWER_WITHIN = 20.0  # seconds a read after them may take (it takes well under one)


def _raise(kind: type[BaseException]):
    raise kind("the sender's resource sharer is gone")


class Unreadable:
    """Unpickles as a departed sender's reply pipe does: by raising."""

    def __init__(self, kind: type[BaseException]) -> None:
        self.kind = kind

    def __reduce__(self):
        return _raise, (self.kind,)


@pytest.fixture
def dht():
    tolerate_departed_senders()
    node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


def _answers(dht: hivemind.DHT) -> bool:
    stamp = get_dht_time()
    return (
        calls.store(dht, "after", None, "still here", stamp + 60, timeout=ANSWER_WITHIN)
        and calls.get(dht, "after", timeout=ANSWER_WITHIN).value == "still here"
    )


@pytest.mark.parametrize("kind", [EOFError, ConnectionRefusedError])
def test_requests_that_cannot_be_read_are_dropped_and_the_dht_answers_the_next(dht, kind):
    for i in range(ORPHANS):
        dht._outer_pipe.send(("_get", [], dict(key=f"k{i}", latest=True, future=Unreadable(kind))))
    assert _answers(dht)
    assert dht.is_alive()


def _send_and_exit(node: hivemind.DHT) -> None:
    for i in range(50):
        node.get(f"k{i}", return_future=True)
    os._exit(0)


def test_senders_that_exit_before_their_reads_are_served_leave_the_dht_alive_and_answering(dht):
    fork = mp.get_context("fork")
    for _ in range(10):
        sender = fork.Process(target=_send_and_exit, args=(dht,))
        sender.start()
        sender.join(timeout=30)
        assert sender.exitcode == 0
    assert _answers(dht)
    assert dht.is_alive()


def test_a_call_to_a_dht_whose_process_ended_gives_up_at_once_not_at_its_timeout(caplog):
    """What a leaving peer whose DHT process died met: each goodbye waited out its timeout, past the stop
    deadline. The parent sees the process has ended and the call says so (a timeout of 600 s would hang here)."""
    tolerate_departed_senders()
    node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    node.kill()
    node.join(timeout=30)
    assert calls.ended(node)
    with caplog.at_level("DEBUG", logger=calls.__name__):
        assert calls.get(node, "k", timeout=600) is None
        assert not calls.store(node, "k", None, 1, get_dht_time() + 60, timeout=600)
        assert not calls.store_many(node, ["a", "b"], None, 1, get_dht_time() + 60, timeout=600)
    gone = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], calls.DHTGone)]
    assert len(gone) >= 3, [r.getMessage() for r in caplog.records]
