"""Every request a server answers is declared (``network/protocol/rpcs.py``): who may send it, on what. The
bootstrap, a provider and a requester's data server build their dispatch tables from the
declarations, and a server whose handlers do not match them is refused as it is built."""

from __future__ import annotations

import pytest

from meshlearn.network.bootstrap.service import Bootstrap, BootstrapSettings
from meshlearn.network.protocol import rpcs
from meshlearn.network.protocol.rpcs import RPCS, Server, UndeclaredRpc, served_by
from meshlearn.network.provider.service import Provider, ProviderSettings
from meshlearn.network.requester.service import Requester
from meshlearn.network.task.datashare import FileShare
from meshlearn.network.task.spec import TaskRequest

SECRET = b"unit-test-secret"
NOWHERE = "127.0.0.1:9"  # a bootstrap address nothing here dials: the servers are built, never started


def _bootstrap(tmp_path) -> Bootstrap:
    return Bootstrap(BootstrapSettings(host="127.0.0.1", port=0, state=str(tmp_path / "b.sqlite")), SECRET)


def _provider(tmp_path) -> Provider:
    return Provider(ProviderSettings(bootstrap=NOWHERE, provider_id="p0", workdir=str(tmp_path / "p0")), SECRET)


def _requester_handlers(tmp_path) -> dict:
    requester = Requester(TaskRequest(data="digits", providers=2), NOWHERE, SECRET, tmp_path / "req",
                          say=lambda _: None)
    return requester.handlers(FileShare())


def _names(server: Server) -> list[str]:
    return [rpc.name for rpc in served_by(server)]


def test_each_server_serves_exactly_its_declared_requests(tmp_path):
    assert list(_bootstrap(tmp_path).server.handlers) == _names(Server.BOOTSTRAP)
    assert list(_provider(tmp_path).server.handlers) == _names(Server.PROVIDER)
    assert list(_requester_handlers(tmp_path)) == _names(Server.REQUESTER)
    assert {"claim.replace", "task.join", "task.checkpoint", "data.chunk", "ping"} <= {rpc.name for rpc in RPCS}


def test_a_request_is_declared_once_per_server_with_who_may_send_it_and_on_what():
    pairs = [(rpc.server, rpc.name) for rpc in RPCS]
    assert len(pairs) == len(set(pairs)), "a request is declared twice for one server"
    for rpc in RPCS:
        assert isinstance(rpc.caller, rpcs.Caller) and rpc.scope and rpc.does, rpc


@pytest.mark.parametrize("server, build", [(Server.BOOTSTRAP, _bootstrap), (Server.PROVIDER, _provider),
                                           (Server.REQUESTER, _requester_handlers)], ids=lambda v: getattr(v, "value", ""))
def test_a_server_with_a_handler_that_has_no_declaration_is_refused_as_it_is_built(server, build, tmp_path,
                                                                                   monkeypatch):
    dropped = served_by(server)[-1]
    monkeypatch.setattr(rpcs, "RPCS", tuple(rpc for rpc in RPCS if rpc != dropped))
    with pytest.raises(UndeclaredRpc, match=rf"undeclared \['{dropped.name}'\]"):
        build(tmp_path)
