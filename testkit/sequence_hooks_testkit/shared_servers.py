# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Servers that the tests of several modules share, for the suites' time:
a `vllm serve` takes tens of seconds to start on the CI machine, and many
modules serve the same configuration.

Each server is named and started at its first use, by the start the
session gave its name. A module declares the names its tests use
(``pytestmark = pytest.mark.shares(name, ...)``; its tests get only
those); a server is stopped once no test left to run declares it (so an
idle server does not hold its memory for the rest of the session), and
at the session's end. A test that ends a server itself (a signal, a
killed engine core) takes it: the server is then its own, and a later
use of the name starts another. Whatever the order the tests run in,
each gets a running server of its configuration.

A suite's conftest imports the hooks below (`pytest_configure`,
`pytest_collection_finish`, `pytest_runtest_teardown`) and the module
fixture `shared_servers`, and gives its servers by a session fixture
`all_shared_servers` (`shared`). After each test's teardown
(its fixtures' included), a shared server that has exited though no test
took it is dropped, so that the next use of its name starts another, and
reported as an error of that test, with the end of its log. No vLLM
import: both flavours use it.
"""

from collections.abc import Collection, Generator
from pathlib import Path
from typing import Any, Callable

import pytest

# The marker a module declares the shared servers its tests use with.
MARK = "shares"
_SERVERS = pytest.StashKey["SharedServers"]()
_NEEDED_AFTER = pytest.StashKey[dict[str, frozenset[str]]]()
# How much of a dead server's log its report shows.
LOG_TAIL_CHARS = 3000


def _exited(name: str, server: Any, code: int) -> str:
    """The report of shared server ``name``, exited with ``code``."""
    log = Path(server.log).read_text(errors="replace")[-LOG_TAIL_CHARS:]
    return (f"the shared server {name!r} exited ({code}) though no test took "
            f"it; dropped: the next use of the name starts another. Its "
            f"log ends:\n{log}")


class SharedServers:
    """The session's shared servers, by name.

    Args:
        starts: Each name's start: returns a started, healthy server (a
            `server.Started`, a `served.Served`: anything with its
            ``process`` and its ``log``).
        stop: Stops a server that is still shared when no test needs it.
    """

    def __init__(self, starts: dict[str, Callable[[], Any]],
                 stop: Callable[[Any], None]) -> None:
        self._starts = starts
        self._stop = stop
        self._running: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        """The server called ``name``, started if none runs.

        Args:
            name: The server's name (a key of the starts).

        Returns:
            The running server, as its start returned it.

        Raises:
            AssertionError: The shared server exited though no test took
                it (since the last test's teardown); it is dropped, so that
                the next use of the name starts another.
        """
        server = self._running.get(name)
        if server is None:
            server = self._running[name] = self._starts[name]()
        code = server.process.poll()
        if code is not None:
            del self._running[name]
            raise AssertionError(_exited(name, server, code))
        return server

    def take(self, name: str) -> Any:
        """The server called ``name`` (started if none runs), no longer
        shared: the caller ends it.

        Args:
            name: The server's name (a key of the starts).

        Returns:
            The running server, as its start returned it (`get`).
        """
        server = self.get(name)
        del self._running[name]
        return server

    def keep(self, names: Collection[str]) -> None:
        """Stops every server still shared but those called ``names``.

        Args:
            names: The names of the servers to keep running.
        """
        for name in [n for n in self._running if n not in names]:
            self._stop(self._running.pop(name))

    def drop_exited(self) -> list[str]:
        """Drops every shared server that has exited though no test took
        it, so that the next use of its name starts another.

        Returns:
            Each dropped server's report: its name, its exit status and the
            end of its log.
        """
        reports = []
        for name, server in list(self._running.items()):
            code = server.process.poll()
            if code is not None:
                del self._running[name]
                reports.append(_exited(name, server, code))
        return reports

    def stop(self) -> None:
        """Stops every server still shared."""
        self.keep(())


class Declared:
    """What a module's tests see of the shared servers: the names its
    `MARK` declares."""

    def __init__(self, servers: SharedServers, names: Collection[str],
                 module: str) -> None:
        self._servers, self._names, self._module = servers, names, module

    def _check(self, name: str) -> None:
        assert name in self._names, (
            f"{self._module} uses the shared server {name!r}: declare it "
            f"(pytestmark = pytest.mark.{MARK}({name!r}))")

    def get(self, name: str) -> Any:
        """`SharedServers.get` of a declared name.

        Args:
            name: The server's name, which the module declares.

        Returns:
            The running server.
        """
        self._check(name)
        return self._servers.get(name)

    def take(self, name: str) -> Any:
        """`SharedServers.take` of a declared name.

        Args:
            name: The server's name, which the module declares.

        Returns:
            The running server, no longer shared: the caller ends it.
        """
        self._check(name)
        return self._servers.take(name)


def declared(item: pytest.Item) -> frozenset[str]:
    """The shared servers a test or a module declares.

    Args:
        item: The test or the module.

    Returns:
        The names its `MARK` (and its module's) declare.
    """
    return frozenset(name for mark in item.iter_markers(MARK)
                     for name in mark.args)


def shared(
        request: pytest.FixtureRequest, starts: dict[str, Callable[[], Any]],
        stop: Callable[[Any], None]) -> Generator[SharedServers, None, None]:
    """A suite's session fixture's body (``yield from shared(...)``): the
    session's shared servers, each stopped once no test left to run
    declares it, and all at the session's end.

    Args:
        request: The session fixture's request.
        starts: Per name, the start of its server.
        stop: Stops a server.

    Yields:
        The session's shared servers.
    """
    servers = SharedServers(starts, stop)
    request.session.stash[_SERVERS] = servers
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def shared_servers(request: pytest.FixtureRequest,
                   all_shared_servers: SharedServers) -> Declared:
    """The shared servers the requesting module declares
    (``pytestmark = pytest.mark.shares(name, ...)``), of the session's
    `all_shared_servers` (a suite's conftest defines it with `shared`)."""
    return Declared(all_shared_servers, declared(request.node),
                    request.node.nodeid)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARK}(*names): the shared servers (by name) the "
        "module's tests use (sequence_hooks_testkit.shared_servers)")


def pytest_collection_finish(session: pytest.Session) -> None:
    # For each test, the shared servers a test after it declares.
    later: frozenset[str] = frozenset()
    needed = session.stash[_NEEDED_AFTER] = {}
    for item in reversed(session.items):
        needed[item.nodeid] = later
        later |= declared(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item,
                            nextitem) -> Generator[None, None, None]:
    # Wraps the teardown, so that the test's fixtures (the last module's
    # too) are torn down before a server they use stops.
    try:
        return (yield)
    finally:
        servers = item.session.stash.get(_SERVERS, None)
        needed = item.session.stash.get(_NEEDED_AFTER, {})
        exited = [] if servers is None else servers.drop_exited()
        if servers is not None and item.nodeid in needed:
            servers.keep(needed[item.nodeid])
        assert not exited, "\n\n".join(exited)
