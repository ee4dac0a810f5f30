"""The live views: the dashboard (who may read it; the bootstrap's and a simulation's page in a real
headless Chromium), the bootstrap's task board and registry history, and TensorBoard files that
read back equal to summary.csv."""

from __future__ import annotations

import csv
import json
import math
import re
import socket
import statistics
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers.browser import chromium, console_errors, keep_screenshot, wait_until
from helpers.hold import MODELS, Hold
from helpers.netproc import free_port, running_in_thread, start_network

from meshlearn.cli.main import main
from meshlearn.errors import BadMessage, UserInputError
from meshlearn.network.bootstrap.taskboard import TaskBoard
from meshlearn.network.protocol.bootstrapapi import TaskProgress

DIGITS_TASK = ("--data", "digits", "--model", "mlp", "--lr", "0.05", "--batch-size", "16")


def _get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _state(port: int) -> dict:
    status, body = _get(f"http://127.0.0.1:{port}/api/state")
    assert status == 200, body
    return json.loads(body)


def _own_address() -> str | None:
    """This machine's first non-loopback IPv4 address (connecting to it is not loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


# ---- who may read the page --------------------------------------------------------------------

def test_the_dashboard_refuses_a_client_from_another_machine_without_its_token():
    from meshlearn.dashboard.server import DashboardServer

    address = _own_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address to connect from")
    server = DashboardServer(lambda: {"kind": "run", "secret": "not shown without the token"}, "0.0.0.0", 0,
                             token="right-token")
    server.start()
    try:
        base = f"http://{address}:{server.port}"
        for path, headers in [("/api/state", None), ("/", None), ("/api/events", None),
                              ("/api/state?token=wrong-token", None),
                              ("/api/state", {"Authorization": "Bearer wrong-token"}),
                              ("/api/state", {"Cookie": "meshlearn_dashboard=wrong-token"})]:
            status, body = _get(base + path, headers)
            assert status == 401 and b"not shown" not in body, (path, status, body)
        status, body = _get(base + "/api/state", {"Authorization": "Bearer right-token"})
        assert status == 200 and json.loads(body)["secret"] == "not shown without the token"
        status, _ = _get(base + "/api/state", {"Cookie": "meshlearn_dashboard=right-token"})
        assert status == 200
        # the token in the address: answered with a cookie, and a redirect that drops it from the address
        request = urllib.request.Request(base + "/?token=right-token")
        opener = urllib.request.build_opener(_NoRedirect)
        with pytest.raises(urllib.error.HTTPError) as redirect:
            opener.open(request, timeout=10)
        assert redirect.value.code == 303 and redirect.value.headers["Location"] == "/"
        assert "meshlearn_dashboard=right-token" in redirect.value.headers["Set-Cookie"]
        assert "HttpOnly" in redirect.value.headers["Set-Cookie"]
        # loopback clients need no token; writes are refused
        assert _get(f"http://127.0.0.1:{server.port}/api/state")[0] == 200
        post = urllib.request.Request(f"http://127.0.0.1:{server.port}/api/state", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(post, timeout=10)
        assert refused.value.code == 405
    finally:
        server.stop()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def test_a_loopback_dashboard_answers_only_this_machine_and_a_bad_listen_value_is_one_line():
    from meshlearn.dashboard.server import DashboardServer, parse_listen

    assert parse_listen("8765") == ("127.0.0.1", 8765)
    assert parse_listen("0.0.0.0:80") == ("0.0.0.0", 80)
    for bad in ("eighty", "host:", "1:2:x", "70000"):
        with pytest.raises(UserInputError, match=r"\[HOST:\]PORT"):
            parse_listen(bad)
    server = DashboardServer(lambda: {"kind": "run"}, "127.0.0.1", 0)
    server.start()
    try:
        assert server.token is None and "token" not in server.url
        taken = DashboardServer(lambda: {}, "127.0.0.1", server.port)
        with pytest.raises(UserInputError, match="cannot listen on 127.0.0.1"):
            taken.start()
    finally:
        server.stop()


def test_the_page_shows_the_state_it_was_served_with_before_any_update_arrives():
    """A screenshot (or a slow client) sees the state from the first response, not "waiting for
    the first update": the event stream is blocked here, so only the served state can show (issue
    33 item 11)."""
    from meshlearn.dashboard.server import DashboardServer

    title = "first-state </script><b>check</b>"
    server = DashboardServer(lambda: {"kind": "network", "title": title, "providers": [], "tasks": [], "history": []},
                             "127.0.0.1", 0)
    server.start()
    try:
        status, body = _get(f"http://127.0.0.1:{server.port}/")
        assert status == 200 and b'<script id="state" type="application/json">' in body
        assert b"</script><b>" not in body  # the state cannot close its block or add markup
        with chromium() as driver:
            driver.execute_cdp_cmd("Network.enable", {})
            driver.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*/api/events*"]})
            driver.get(f"http://127.0.0.1:{server.port}/")
            shown = wait_until(lambda: driver.find_element("id", "title").text == title, 10, "the served title")
            assert shown and "waiting for the first update" not in driver.page_source
            assert not [m for m in console_errors(driver) if "api/events" not in m]
    finally:
        server.stop()


def test_a_page_under_another_name_cannot_read_a_loopback_dashboard():
    """DNS rebinding: a page at a name whose DNS now points at 127.0.0.1 makes this machine's browser
    send its own name as Host; the dashboard answers only names of this machine (issue 32 item 13)."""
    from meshlearn.dashboard.server import DashboardServer

    server = DashboardServer(lambda: {"kind": "run", "title": "secret-ish"}, "127.0.0.1", 0)
    server.start()
    try:
        url = f"http://127.0.0.1:{server.port}/api/state"
        for host in (f"rebind.attacker.example:{server.port}", "attacker.example", f"127.0.0.1.nip.io:{server.port}"):
            status, body = _get(url, {"Host": host})
            assert status == 403 and b"secret-ish" not in body and b"DNS-rebinding" in body, (host, status)
        for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", f"[::1]:{server.port}",
                     f"{socket.gethostname()}:{server.port}"):
            assert _get(url, {"Host": host})[0] == 200, host
    finally:
        server.stop()


def test_a_flood_of_idle_connections_neither_fills_the_dashboard_nor_locks_its_page_out():
    """Connections that never send a request are capped (the oldest idle one makes room for a
    newcomer) and closed after a while, so the descriptors of the process stay bounded."""
    from meshlearn.dashboard.connections import MAX_CONNECTIONS
    from meshlearn.dashboard.server import DashboardServer

    server = DashboardServer(lambda: {"kind": "run", "title": "t"}, "127.0.0.1", 0)
    server.start()
    idle = []
    try:
        for _ in range(3 * MAX_CONNECTIONS):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        assert _state(server.port)["title"] == "t"  # the page still loads
        held = server._server.server_state.connections
        wait_until(lambda: len(held) <= MAX_CONNECTIONS + 1, 10, f"at most {MAX_CONNECTIONS} connections held")
        closed = 0
        for sock in idle:  # the server closed all but the newest: each reads end-of-file
            sock.settimeout(0.01)
            try:
                closed += sock.recv(1) == b""
            except (TimeoutError, OSError):
                pass
        assert closed >= 2 * MAX_CONNECTIONS - 1, closed
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_the_page_gets_plain_json_even_from_a_source_with_nan_or_one_that_fails():
    from meshlearn.dashboard.server import Snapshots

    assert json.loads(Snapshots(lambda: {"a": math.nan, "b": [1.5, -math.inf], "c": (1, "x")}).text()) == \
        {"a": None, "b": [1.5, None], "c": [1, "x"]}

    def broken():
        raise RuntimeError("registry closed")
    assert json.loads(Snapshots(broken).text()) == {"kind": "error", "title": "meshlearn",
                                                    "message": "RuntimeError: registry closed"}


# ---- what the bootstrap keeps for the page ----------------------------------------------------

def _report(board: TaskBoard, task: str, body: dict) -> None:
    """One report as the bootstrap takes it: validated into ``task.progress``'s model, then applied."""
    board.report(TaskProgress.read({"task": task, **body}, "task.progress"))


def test_the_task_board_keeps_curves_faults_and_result_and_refuses_bad_reports():
    board = TaskBoard()
    _report(board, "t1", {"providers": {"p0": {"state": "training", "iteration": 2, "iterations": 10,
                                             "train_loss": 2.0, "test_acc": None, "evaluated_at": None}}})
    _report(board, "t1", {"providers": {"p0": {"state": "training", "iteration": 4, "iterations": 10, "train_loss": 1.5,
                                             "test_acc": 0.5, "evaluated_at": 4, "leader": "p0"},
                                      "p1": {"state": "training", "iteration": 3, "iterations": 10,
                                             "train_loss": 1.7}},
                        "faults": ["provider p2 stopped answering"]})
    _report(board, "t1", {"providers": {}, "result": {"accuracy": 0.9}})
    view = board.view("t1")
    assert view["curve"]["iteration"] == [2, 3, 4]
    series = {s["provider"]: s for s in view["curve"]["series"]}
    assert series["p0"]["train_loss"] == [2.0, None, 1.5] and series["p0"]["test_acc"] == [None, None, 0.5]
    assert series["p1"]["train_loss"] == [None, 1.7, None]
    assert [f["text"] for f in view["faults"]] == ["provider p2 stopped answering"]
    assert view["result"] == {"accuracy": 0.9} and view["leader"] == "p0"
    _report(board, "t2", {"providers": {}, "result": {"accuracy": 0.4, "perplexity": 7.5}})  # a language model's
    assert board.view("t2")["result"] == {"accuracy": 0.4, "perplexity": 7.5}
    for bad, message in [({"providers": {"p0": {"iteration": -1}}}, "p0.iteration': .* greater than or equal to 0"),
                         ({"providers": {"p0": {"train_loss": math.nan}}}, "'providers.p0.train_loss': .* finite"),
                         ({"providers": {"p0": {"state": "<script>"}}}, "'providers.p0.state': .* 'preparing', 'ready'"),
                         ({"providers": ["p0"]}, "'providers': Input should be a valid dictionary"),
                         ({"faults": ["x" * 1000]}, "'faults.0': String should have at most 256 characters"),
                         ({"providers": {"p0": {"iteration": "3"}}}, "'providers.p0.iteration': .* valid integer"),
                         ({"result": {"perplexity": math.inf}}, "'result.perplexity': .* finite number")]:
        with pytest.raises(BadMessage, match=message):
            _report(board, "t1", bad)
    assert board.view("t1")["curve"]["iteration"] == [2, 3, 4]  # a refused report changes nothing
    assert board.view("unknown") is None


def test_the_task_board_says_which_tasks_were_reported_before_the_bootstrap_restarted():
    """A task older than the board that it never heard of was reported to an earlier run of the
    bootstrap: the page says so instead of showing it claimed with no progress (issue 33 item 11)."""
    from meshlearn.clock import FakeClock

    clock = FakeClock()
    old = {"id": "old", "status": "done", "created": clock.time() - 60}
    running = {"id": "running", "status": "running", "created": clock.time() - 60}
    board = TaskBoard(clock)
    clock.advance(5)
    new = {"id": "new", "status": "running", "created": clock.time()}
    assert board.page_view(old) == {"live": False, "note": "no live data: reported before the bootstrap restarted"}
    assert board.page_view(running)["live"] is False and "restarted while this task ran" in \
        board.page_view(running)["note"]
    assert board.page_view(new) == {}  # claimed since, nothing reported yet
    _report(board, "running", {"providers": {"p0": {"state": "training", "iteration": 3, "iterations": 10}}})
    assert board.page_view(running)["live"] is True and board.page_view(running)["progress"]["p0"]["iteration"] == 3


def test_the_registry_keeps_its_history_across_a_restart(tmp_path):
    from meshlearn.clock import FakeClock
    from meshlearn.network.bootstrap.registry import ProviderInfo, Registry

    clock = FakeClock()
    registry = Registry(tmp_path / "r.sqlite", clock).open()
    registry.register(ProviderInfo("p0", "10.0.0.1:9000", 8.0, 4, "cpu", "lab"))
    registry.register(ProviderInfo("p0", "10.0.0.1:9000", 8.0, 4, "cpu", "lab"))  # a refresh is no event
    registry.register(ProviderInfo("p1", "10.0.0.2:9000", 8.0, 4, "cpu", ""))
    registry.claim("t1", "requester-t1", 2)
    registry.release("t1", "done", lost=["p1"])
    clock.advance(100)
    registry.expire(30)
    registry.close()
    again = Registry(tmp_path / "r.sqlite", clock).open()
    kinds = [(e["kind"], e["subject"]) for e in reversed(again.history())]
    # p1, which the task lost, stays bound to its key until it expires (nobody else can take its id)
    assert kinds == [("registered", "p0"), ("registered", "p1"), ("claimed", "t1"), ("released", "t1"),
                     ("expired", "p0"), ("expired", "p1")]
    assert again.history()[2]["detail"] == "done; lost p1"
    assert [t["id"] for t in again.tasks()] == ["t1"]
    again.close()


# ---- the bootstrap's page in a real browser ---------------------------------------------------

# slow (about 35 s): the default run keeps a simulation's page live in chromium (below) and the task board's
# curves, faults and result (test_the_task_board_keeps_curves_faults_and_result_and_refuses_bad_reports)
@pytest.mark.slow
@pytest.mark.timeout(280)
def test_the_bootstraps_page_lists_providers_and_follows_a_task_live_in_chromium(procs, tmp_path):
    # the task waits at its providers' 20th and 60th steps (of 600) until the page has shown each point
    hold = Hold(procs.folder, 20, 60)
    with chromium() as browser:
        page_port = free_port()
        bootstrap, ids = start_network(procs, 3, bootstrap_args=("--dashboard", str(page_port)),
                                       provider_args=("--models-module", MODELS), provider_env=hold.env)
        procs.wait_for("bootstrap", rf"dashboard: http://127\.0\.0\.1:{page_port}/")
        browser.get(f"http://127.0.0.1:{page_port}/")
        # the page is drawn afresh at each update: read it in one script, never through held elements
        rows = wait_until(lambda: _attrs(browser, "#providers tbody tr", "data-id") if
                          len(_attrs(browser, "#providers tbody tr", "data-id")) == 3 else None, 30,
                          "3 providers on the page")
        assert sorted(rows) == sorted(ids)  # shown from the state the page came with, then live
        wait_until(lambda: _attrs(browser, "#connection", "data-state") == ["live"], 30, "the live event stream")

        procs.start("request", "request", "--bootstrap", bootstrap, "--output", str(tmp_path / "result"), *DIGITS_TASK,
                    "--model", "held-mlp", "--models-module", MODELS,
                    "--epochs", "20", "--providers", "3", "--aggregate-every", "1", "--eval-every", "60",
                    "--tensorboard", str(tmp_path / "tb"))
        task_id = procs.wait_for("request", r"task (\w+): 3 provider\(s\)").group(1)
        task = f'.task[data-id="{task_id}"]'

        def points() -> int | None:
            return browser.execute_script(
                "const t = document.querySelector(arguments[0]);"
                "if (!t || t.dataset.status !== 'running') return null;"
                "const c = t.querySelector(arguments[1]); return c ? Number(c.dataset.points) : null;",
                task, f'[data-chart="loss-{task_id}"]')

        seen = []  # the curve's point counts, as the page showed them while the task ran
        for _ in hold.steps:  # one count while the task waits at each step (it surely runs), a greater one next
            hold.wait_held(procs, ids)
            seen.append(wait_until(lambda: (points() or 0) > max(seen, default=0) and points(), 60,
                                   f"the page to show more than {max(seen, default=0)} points of the running task"))
            hold.release()
        while procs.procs["request"].poll() is None:
            count = points()
            if count is not None and (not seen or seen[-1] != count):
                seen.append(count)
            time.sleep(0.2)
        assert procs.procs["request"].returncode == 0, procs.log("request")
        print("point counts while running", seen)
        assert len([c for c in seen if c > 0]) >= 2 and seen == sorted(seen), \
            f"point counts while running: {seen}\n{procs.log('request')}"
        wait_until(lambda: _attrs(browser, task, "data-status") == ["done"], 30, "the page to show the task done")
        assert re.search(r"result: test accuracy \d+\.\d%", _text(browser, task))
        assert int(_attrs(browser, f'[data-chart="acc-{task_id}"]', "data-points")[0]) >= 2  # evaluations as they came
        history = " ".join(_text(browser, "#history").split())
        assert f"claimed {task_id}" in history and "released" in history
        keep_screenshot(browser, "dashboard-bootstrap")
        assert console_errors(browser) == []
        page = browser.page_source
        assert "safetensors" not in page and "shard" not in page.lower()
        assert (tmp_path / "tb" / f"task-{task_id}" / "provider_p0").is_dir()


def _attrs(browser, selector: str, name: str) -> list[str]:
    """Attribute ``name`` of every element ``selector`` finds, read at one instant."""
    return browser.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.getAttribute(arguments[1]));",
        selector, name)


def _text(browser, selector: str) -> str:
    return browser.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : '';",
                                  selector)


# ---- a run's page in a browser: charts, legends, the time split, the histogram -------------------

def _flat_events(nodes: int, iterations: int, every: int = 5) -> list[dict]:
    """Log events where every node has the same accuracy (std 0: the mean and both std lines meet),
    rising then flat from half-way; each iteration takes 10 ms of training and 20 ms of sending."""
    events = [{"event": "start", "rank": r} for r in range(nodes)]
    for it in range(iterations):
        events += [{"event": "iteration", "rank": r, "iteration": it, "train": 0.01, "comm": 0.02,
                    "train_loss": 2.0 - it * 0.01} for r in range(nodes)]
        if (it + 1) % every == 0:
            acc = min(0.5, 0.1 + 0.8 * (it + 1) / iterations)
            events += [{"event": "eval", "rank": r, "iteration": it + 1, "t": it * 0.03, "test_acc": acc,
                        "test_loss": 1.0} for r in range(nodes)]
    return events


def _served_board(board):
    from meshlearn.dashboard.server import DashboardServer

    server = DashboardServer(board.snapshot, "127.0.0.1", 0)
    server.start()
    return server


_CHART_SIZES = """return Array.from(document.querySelectorAll('.chart')).map(box => {
    const canvas = box.querySelector('canvas');
    return [box.dataset.chart, box.getBoundingClientRect().width, canvas ? canvas.getBoundingClientRect().width : 0];
});"""

_LEGEND = """const box = document.querySelector(`[data-chart="${arguments[0]}"]`);
return Object.fromEntries(Array.from(box.querySelectorAll('.u-legend .u-series')).map(
    row => [row.querySelector('.u-label').textContent, row.querySelector('.u-value').textContent]));"""


def _pixel_on(browser, key: str, x: float, y: float) -> list[int]:
    """The RGB of chart ``key``'s canvas at data point (x, y)."""
    return browser.execute_script(
        "const plot = charts.get(arguments[0]).plot;"
        "const px = Math.round(plot.valToPos(arguments[1], 'x', true));"
        "const py = Math.round(plot.valToPos(arguments[2], 'y', true));"
        "return Array.from(plot.ctx.getImageData(px, py, 1, 1).data.slice(0, 3));", key, x, y)


def _near(colour: list[int], hex_colour: str, tolerance: int = 30) -> bool:
    wanted = [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]
    return all(abs(a - b) <= tolerance for a, b in zip(colour, wanted))


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the page tests of this module that need no processes."""
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def eight_nodes():
    """The page of an 8-node process run (``_flat_events``), served from this process."""
    from meshlearn.config import make_config
    from meshlearn.sim.live import RunBoard

    board = RunBoard(make_config({"nodes": 8, "iterations": 40}), "eight")
    board.add(_flat_events(8, 40))
    server = _served_board(board)
    yield server.url
    server.stop()


def _open(browser, url: str, charts: int) -> None:
    """Load ``url`` at the usual window size, once its ``charts`` charts are drawn."""
    browser.set_window_size(1280, 1600)
    browser.get(url)

    def drawn() -> bool:
        sizes = browser.execute_script(_CHART_SIZES)
        return len(sizes) == charts and all(canvas for _, _, canvas in sizes)
    wait_until(drawn, 10, f"{charts} charts drawn")


def test_a_runs_charts_fill_their_panels_and_follow_a_resize_in_chromium(browser, eight_nodes):
    """Issue 33 item 11: charts were a third of their panel (sized before the panel was laid out)."""
    _open(browser, eight_nodes, 2)
    sizes = browser.execute_script(_CHART_SIZES)
    for key, box, canvas in sizes:
        assert box > 400 and canvas >= 0.95 * box, (key, box, canvas)
    browser.set_window_size(1000, 1600)  # narrower panels: the charts follow
    wait_until(lambda: all(abs(c - b) <= 0.05 * b and b < sizes[0][1] - 40
                           for _, b, c in browser.execute_script(_CHART_SIZES)), 10, "charts resized")
    keep_screenshot(browser, "dashboard-run-resized")
    assert console_errors(browser) == []


def test_a_runs_legends_show_the_latest_values_unless_hovered_in_chromium(browser, eight_nodes):
    """Issue 33 item 11: legends read "--" until hovered; now the latest values, the hovered
    point's while the cursor is over the chart, and the latest again when it leaves."""
    from selenium.webdriver import ActionChains

    _open(browser, eight_nodes, 2)
    legend = browser.execute_script(_LEGEND, "acc")
    assert legend["iteration"] == "40" and legend["mean"] == "50.00%", legend
    assert "--" not in legend.values() and "--" not in browser.execute_script(_LEGEND, "loss").values()
    over = browser.find_element("css selector", '[data-chart="acc"] .u-over')
    ActionChains(browser).move_to_element_with_offset(over, -over.size["width"] // 2 + 2, 0).perform()
    wait_until(lambda: browser.execute_script(_LEGEND, "acc")["iteration"] == "5", 5, "the hovered value")
    ActionChains(browser).move_to_element(browser.find_element("id", "title")).perform()
    wait_until(lambda: browser.execute_script(_LEGEND, "acc")["iteration"] == "40", 5, "the latest value again")
    assert console_errors(browser) == []


def test_a_runs_mean_accuracy_is_drawn_over_its_std_lines_in_chromium(browser, eight_nodes):
    """Issue 33 item 11: with std 0 the mean, mean - std and mean + std lines meet; the colour on
    top is the mean's (it was the last std line's)."""
    _open(browser, eight_nodes, 2)
    on_line = _pixel_on(browser, "acc", 32.5, 0.5)  # between two evaluations of the flat part
    assert _near(on_line, "#3f6fd8"), on_line
    keep_screenshot(browser, "dashboard-run-charts")


def test_a_runs_iteration_time_says_each_phases_time_and_unit_in_chromium(browser, eight_nodes):
    """Issue 33 item 11: the iteration-time bar had no numbers or units."""
    _open(browser, eight_nodes, 2)
    split = " ".join(_text(browser, ".iteration-time").split())
    assert "train 10.0 ms" in split and "comm 20.0 ms" in split and "= 30.0 ms per iteration" in split, split
    row = " ".join(_text(browser, 'table.nodes tr[data-rank="0"]').split())
    assert "30.0 ms" in row, row


def _batched_events(nodes: int, iterations: int) -> list[dict]:
    """A batched run's log (as per_node expands it): 20 ms of modelled training for everyone, and
    modelled waits for a few nodes only, at different iterations (most nodes wait 0)."""
    from meshlearn.runlog import columnar_event, per_node

    ranks = list(range(nodes))
    columnar = [columnar_event("start", ranks, {"byzantine": [None] * nodes}, engine="batched")]
    for it in range(iterations):
        comm = [0.004 * (1 + it % 3) if r % 10 == it % 10 else 0.0 for r in ranks]
        columnar.append(columnar_event("iteration", ranks, {"train": [0.02] * nodes, "encode": [0.0] * nodes,
                                                            "average": [0.0] * nodes, "comm": comm,
                                                            "train_loss": [1.0] * nodes}, iteration=it))
    columnar.append(columnar_event("eval", ranks, {"t": [1.0] * nodes, "test_loss": [1.0] * nodes,
                                                   "test_acc": [0.85 + 0.1 * r / nodes for r in ranks]},
                                   iteration=iterations))
    return [one for event in columnar for one in per_node(event)]


@pytest.fixture(scope="module")
def many_nodes():
    """A 100-node batched run's board and log events (``_batched_events``)."""
    from meshlearn.config import make_config
    from meshlearn.sim.live import RunBoard

    events = _batched_events(100, 30)
    board = RunBoard(make_config({"nodes": 100, "iterations": 30, "engine": "batched"}), "many")
    board.add(events)
    server = _served_board(board)
    yield board, events, server.url
    server.stop()


def _figure_split(events: list[dict]) -> dict[str, float]:
    """Each phase's ms in iteration_time.png's bar of these events (one bar: over all nodes)."""
    from meshlearn.sim.figures import time_split_figure
    from meshlearn.sim.tables import PHASES

    logs: dict[int, list[dict]] = {}
    for event in events:
        logs.setdefault(event["rank"], []).append(event)
    figure = time_split_figure(logs, "many", modelled=True)
    drawn = {phase: bars.patches[0].get_width() for phase, bars in zip(PHASES, figure.axes[0].containers)}
    figure.clear()
    return drawn


def test_a_batched_runs_board_has_the_time_split_of_iteration_time_png(many_nodes):
    """Issue 33 item 11: the live page showed the batched engine's iterations as all "train" (the
    median node's latest iteration waits 0), iteration_time.png the modelled split (means over the
    log); both now read the log through one rule (report.PhaseTimes)."""
    board, events, _ = many_nodes
    drawn = _figure_split(events)
    assert drawn["comm"] > 0
    state = board.snapshot()
    assert {p: 1000 * seconds for p, seconds in state["phases"].items()} == pytest.approx(drawn)
    assert state["clock"] == "modelled"


def test_a_batched_runs_page_shows_the_time_split_of_iteration_time_png_in_chromium(browser, many_nodes):
    """The same split on the page, each phase with its unit, and said to be modelled."""
    drawn = _figure_split(many_nodes[1])
    _open(browser, many_nodes[2], 3)
    split = " ".join(_text(browser, ".iteration-time").split())
    assert f"comm {drawn['comm']:.2f} ms" in split and "train 20.0 ms" in split, split
    assert "modelled" in _text(browser, "section.run")
    assert console_errors(browser) == []


def test_a_runs_accuracy_histogram_is_drawn_as_bars_in_chromium(browser, many_nodes):
    """Issue 33 item 11: the histogram of more than 64 nodes' accuracies was a line."""
    _open(browser, many_nodes[2], 3)
    # bars fill a good part of the plot; a line through 20 bins colours a few percent of it
    filled = browser.execute_script(
        "const plot = charts.get('hist').plot;"
        "const b = plot.bbox, pixels = plot.ctx.getImageData(b.left, b.top, b.width, b.height).data;"
        "let blue = 0; for (let i = 0; i < pixels.length; i += 4)"
        "  if (pixels[i + 3] > 0 && pixels[i + 2] > pixels[i] + 40) blue++;"
        "return blue / (b.width * b.height);")
    assert filled > 0.2, filled
    keep_screenshot(browser, "dashboard-run-many")
    assert console_errors(browser) == []


def test_a_task_from_before_a_bootstrap_restart_shows_its_record_not_empty_live_views_in_chromium(tmp_path, browser):
    """Issue 33 item 11: a task whose reports went to an earlier run of the bootstrap shows its
    registry status and providers, and says it has no live data, instead of "claimed 0/?" and
    empty charts; a task claimed since, with no report yet, has no empty charts either."""
    from meshlearn.dashboard.server import DashboardServer
    from meshlearn.network.bootstrap.registry import ProviderInfo, Registry
    from meshlearn.network.bootstrap.service import Bootstrap, BootstrapSettings

    state = tmp_path / "b.sqlite"
    earlier = Registry(state).open()
    for i in range(3):
        earlier.register(ProviderInfo(f"p{i}", f"10.0.0.{i}:9000", 8.0, 4, "cpu", "lab"))
    earlier.claim("old1", "requester-old", 2)
    earlier.release("old1", "done")
    earlier.close()
    service = Bootstrap(BootstrapSettings(host="127.0.0.1", port=0, state=str(state), dial_back=False),
                        b"unit-test-secret")
    with running_in_thread(service):
        service.registry.claim("new1", "requester-new", 1)
        with DashboardServer(service.board, "127.0.0.1", 0) as server:
            browser.set_window_size(1280, 1600)
            browser.get(server.url)
            text = wait_until(lambda: " ".join(_text(browser, '.task[data-id="old1"]').split()), 10, "the old task")
            assert "no live data: reported before the bootstrap restarted" in text, text
            assert "registry status done" in text and "p0, p1" in text and "released" in text, text
            assert "0 / ?" not in text and _attrs(browser, '.task[data-id="old1"] tbody tr', "data-id") == [], text
            new = " ".join(_text(browser, '.task[data-id="new1"]').split())
            assert "no report yet" in new and "0 / ?" not in new, new
            assert _attrs(browser, ".task .chart", "data-chart") == []  # no empty charts
            keep_screenshot(browser, "dashboard-bootstrap-restarted")
            assert console_errors(browser) == []
        board = service.board()
        old = next(t for t in board["tasks"] if t["id"] == "old1")
        assert old["live"] is False and "before the bootstrap restarted" in old["note"]
        assert old["released"]["detail"] == "done"
        assert "live" not in next(t for t in board["tasks"] if t["id"] == "new1")  # claimed since, no report yet


# ---- a simulation's page and its TensorBoard files --------------------------------------------

def _tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


@pytest.mark.timeout(240)
def test_a_simulations_page_shows_its_nodes_live_and_its_tensorboard_files_equal_summary_csv(tmp_path, procs):
    pytest.importorskip("tensorboard")
    with chromium() as browser:
        port = free_port()
        output, tb = tmp_path / "run", tmp_path / "tb"
        hold = Hold(tmp_path, 30, 120)  # the run waits at its nodes' 30th and 120th steps (of 250) for the page
        procs.start("simulate", "simulate", "--nodes", "4", "--topology", "ring", "--dataset", "digits",
                    "--model", "held-mlp", "--models-module", MODELS,
                    "--iterations", "250", "--test-after", "50", "--byzantine", "3:sign-flip:10",
                    "--aggregation", "trimmed-mean:1", "--output", str(output), "--quiet",
                    "--dashboard", str(port), "--tensorboard", str(tb), env=hold.env)
        procs.wait_for("simulate", rf"dashboard: http://127\.0\.0\.1:{port}/")
        browser.get(f"http://127.0.0.1:{port}/")
        wait_until(lambda: len(_attrs(browser, "table.nodes tbody tr", "data-rank")) == 4, 60, "a row per node")
        assert "sign-flip" in _text(browser, 'table.nodes tr[data-rank="3"]')

        def points() -> int:
            return int((_attrs(browser, '[data-chart="loss"]', "data-points") or ["0"])[0])

        def running() -> bool:
            return procs.procs["simulate"].poll() is None

        hold.wait_count(4, running)
        first = wait_until(points, 60, "train loss points")
        hold.release()
        hold.wait_count(4, running)
        wait_until(lambda: points() > first, 60, "more points while the run goes")
        hold.release()
        keep_screenshot(browser, "dashboard-simulate")
        assert console_errors(browser) == []
    assert procs.procs["simulate"].wait(timeout=200) == 0, procs.log("simulate")

    rows = list(csv.DictReader((output / "summary.csv").open()))
    mean = _tensorboard_scalars(tb / "run" / "mean")
    assert [int(r["iteration"]) for r in rows] == sorted(mean["test/accuracy"])
    for row in rows:
        step = int(row["iteration"])
        for column, tag in [("test_acc_mean", "test/accuracy"), ("test_acc_std", "test/accuracy_std"),
                            ("test_loss_mean", "test/loss"), ("test_loss_std", "test/loss_std"),
                            ("time_mean", "time/elapsed"), ("attackers_acc_mean", "bad_nodes/accuracy")]:
            assert mean[tag][step] == pytest.approx(float(row[column]), rel=1e-6, abs=1e-7), (tag, step)
    node = _tensorboard_scalars(tb / "run" / "node_1")
    log = [json.loads(line) for line in (output / "logs" / "node_1.jsonl").read_text().splitlines()]
    losses = {e["iteration"] + 1: e["train_loss"] for e in log if e["event"] == "iteration"}
    assert len(node["train/loss"]) == 250
    assert all(node["train/loss"][step] == pytest.approx(value, rel=1e-6) for step, value in losses.items())
    assert {"time/comm", "traffic/bytes_sent", "test/accuracy"} <= set(node)
    for png in ("topology.png", "iteration_time.png"):
        assert (output / png).stat().st_size > 10_000


def test_the_tensorboard_flag_without_the_package_is_one_line(monkeypatch, capsys, tmp_path):
    import builtins

    real_import = builtins.__import__

    def without_tensorboard(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_tensorboard)
    code = main(["simulate", "--nodes", "4", "--dataset", "digits", "--iterations", "1", "--output",
                 str(tmp_path / "r"), "--tensorboard", str(tmp_path / "tb")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "pip install 'meshlearn[tensorboard]'" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r").exists()


# ---- the pieces behind the pages, without processes -------------------------------------------

def test_the_log_tail_reads_only_complete_new_lines_and_starts_over_on_a_new_file(tmp_path):
    from meshlearn.runlog import COLUMNAR_LOG, LogTail, columnar_event

    logs = tmp_path / "logs"
    logs.mkdir()
    tail = LogTail(logs)
    assert tail.read() == []
    node = logs / "node_2.jsonl"
    node.write_text('{"event":"start"}\n{"event":"iteration","iteration":0}\n{"event":"itera')
    assert [(e["event"], e["rank"]) for e in tail.read()] == [("start", 2), ("iteration", 2)]
    with node.open("a") as handle:
        handle.write('tion","iteration":1}\n')
    assert [e["iteration"] for e in tail.read()] == [1]
    (logs / COLUMNAR_LOG).write_text(json.dumps(columnar_event("eval", [0, 1], {"test_acc": [0.5, 0.6]},
                                                               iteration=10)) + "\n")
    assert [(e["rank"], e["test_acc"]) for e in tail.read()] == [(0, 0.5), (1, 0.6)]
    node.unlink()
    node.write_text('{"event":"start"}\n')  # a rerun's fresh log
    assert [e["event"] for e in tail.read()] == ["start"]


def _events(nodes: int, iterations: int, bad: int | None = None) -> list[dict]:
    events = [{"event": "start", "rank": r} for r in range(nodes)]
    for it in range(iterations):
        for r in range(nodes):
            events.append({"event": "iteration", "rank": r, "iteration": it, "train": 0.01, "comm": 0.02,
                           "train_loss": 2.0 - it * 0.1 + r * 0.01, "missing": 1 if r == 0 else 0,
                           "chunks_missing": 2, "bytes_sent": 1000 * (it + 1)})
        if (it + 1) % 5 == 0:
            events += [{"event": "eval", "rank": r, "iteration": it + 1, "t": it * 0.1,
                        "test_acc": 0.1 * (it + 1) / iterations + r / (10 * nodes), "test_loss": 1.0}
                       for r in range(nodes)]
    return events


def test_a_run_board_shows_nodes_or_for_many_nodes_their_distribution():
    from meshlearn.config import make_config
    from meshlearn.sim.live import ExperimentBoard, RunBoard

    config = make_config({"nodes": 4, "iterations": 10, "byzantine": "3:sign-flip:10"})
    board = RunBoard(config, "small")
    board.add(_events(4, 10))
    state = json.loads(json.dumps(board.snapshot(), allow_nan=False))
    assert state["status"] == "running" and state["iteration"] == 10
    assert state["eval"]["iteration"] == [5, 10] and len(state["eval"]["attackers_acc"]) == 2
    assert state["eval"]["acc_mean"][-1] == pytest.approx(statistics_mean([0.1 + r / 40 for r in range(3)]))
    assert state["train"]["iteration"] == list(range(1, 11))
    assert [n["bad"] for n in state["nodes"]] == [None, None, None, "sign-flip:10"]
    assert state["nodes"][0]["timeouts"] == 10 and state["nodes"][1]["chunks_missing"] == 20
    assert state["totals"]["bytes_sent"] == 4 * 10_000 and "distribution" not in state

    many = RunBoard(make_config({"nodes": 100, "iterations": 5, "engine": "batched"}), "many")
    many.add(_events(100, 5))
    state = many.snapshot()
    assert state["nodes"] is None and state["distribution"]["count"] == 100
    assert sum(state["distribution"]["histogram"]["counts"]) == 100
    edges = state["distribution"]["histogram"]["edges"]  # the accuracies' range (at least 10 points), not 0-100%
    assert edges[0] <= state["distribution"]["quantiles"][0] and edges[-1] >= state["distribution"]["quantiles"][-1]
    assert 0.1 <= edges[-1] - edges[0] < 0.2 and len(edges) == 21

    experiment = ExperimentBoard("study", ["a", "b"])
    run = experiment.begin("a", config)
    run.add(_events(4, 10))
    experiment.end("a")
    state = experiment.snapshot()
    assert [(r["name"], r["status"]) for r in state["runs"]] == [("a", "done"), ("b", "waiting")]
    assert state["runs"][0]["accuracy"] == pytest.approx(statistics_mean([0.1 + r / 40 for r in range(3)]))
    assert state["current"]["status"] == "done"


def _lm_events(nodes: int, iterations: int) -> list[dict]:
    """A language model's log events: each evaluation with a perplexity (node r's: 40 - iteration + r)."""
    events = [{"event": "start", "rank": r} for r in range(nodes)]
    for it in range(iterations):
        events += [{"event": "iteration", "rank": r, "iteration": it, "train": 0.01, "train_loss": 3.0}
                   for r in range(nodes)]
        if (it + 1) % 5 == 0:
            events += [{"event": "eval", "rank": r, "iteration": it + 1, "t": it * 0.1, "test_acc": 0.3,
                        "test_loss": 3.0, "test_perplexity": 40.0 - it + r} for r in range(nodes)]
    return events


def test_a_language_models_board_leads_with_perplexity_and_tensorboard_has_it(tmp_path):
    from meshlearn.config import make_config
    from meshlearn.sim.live import ExperimentBoard, RunBoard
    from meshlearn.sim.tbsink import TensorBoardSink

    config = make_config({"nodes": 4, "iterations": 10, "dataset": "pystdlib", "model": "gpt-tiny"})
    board = RunBoard(config, "lm")
    board.add(_lm_events(4, 10))
    state = json.loads(json.dumps(board.snapshot(), allow_nan=False))
    assert state["metric"] == "perplexity" and state["eval"]["ppl_mean"] == [37.5, 32.5]
    assert state["eval"]["ppl_std"][0] == pytest.approx(statistics.pstdev([36, 37, 38, 39]), rel=1e-6)
    assert [n["test_perplexity"] for n in state["nodes"]] == [31.0, 32.0, 33.0, 34.0]
    many = RunBoard(make_config({"nodes": 101, "iterations": 5, "engine": "batched"}), "many")
    events = _lm_events(101, 5)
    next(e for e in events if e["event"] == "eval" and e["rank"] == 100)["test_perplexity"] = math.inf  # diverged
    many.add(events)
    spread = many.snapshot()["distribution"]  # perplexities 36 .. 135: their own range, not 0-100%; no inf
    assert spread["quantiles"][0] == 36 and spread["quantiles"][-1] == 135 and sum(spread["histogram"]["counts"]) == 100
    assert spread["histogram"]["edges"][0] == 36 and spread["histogram"]["edges"][-1] == pytest.approx(135)
    images = RunBoard(make_config({"nodes": 4, "iterations": 10}), "images")
    images.add(_events(4, 10))
    assert images.snapshot()["metric"] == "accuracy" and "ppl_mean" not in images.snapshot()["eval"]
    experiment = ExperimentBoard("study", ["lm"])
    experiment.begin("lm", config).add(_lm_events(4, 10))
    experiment.end("lm")
    assert experiment.snapshot()["runs"][0]["perplexity"] == pytest.approx(32.5)

    pytest.importorskip("tensorboard")
    sink = TensorBoardSink(config, tmp_path / "tb")
    sink.add(_lm_events(4, 10))
    sink.close()
    assert _tensorboard_scalars(tmp_path / "tb" / "mean")["test/perplexity"] == {5: 37.5, 10: 32.5}
    assert _tensorboard_scalars(tmp_path / "tb" / "node_2")["test/perplexity"] == {5: 38.0, 10: 33.0}


def test_a_language_models_page_shows_perplexity_in_chromium(browser):
    from meshlearn.config import make_config
    from meshlearn.sim.live import ExperimentBoard

    experiment = ExperimentBoard("study", ["lm"])
    experiment.begin("lm", make_config({"nodes": 4, "iterations": 10})).add(_lm_events(4, 10))
    experiment.end("lm")
    server = _served_board(experiment)
    browser.get("about:blank")  # leave the page before (its server may be gone) and drop what it logged
    console_errors(browser)
    try:
        _open(browser, server.url, 2)
        assert "final perplexity" in _text(browser, "#runs") and "32.50" in _text(browser, "#runs")
        assert browser.execute_script(_LEGEND, "current-acc")["mean"] == "32.50"
        assert "mean test perplexity 32.50" in _text(browser, "section.run")
        assert "test ppl" in _text(browser, "table.nodes") and "34.00" in _text(browser, 'table.nodes tr[data-rank="3"]')
        assert console_errors(browser) == []
    finally:
        server.stop()


def statistics_mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_the_requesters_watch_reports_progress_lost_providers_and_leader_changes():
    from meshlearn.clock import FakeClock
    from meshlearn.network.protocol.providerapi import RunStatus
    from meshlearn.network.requester.taskwatch import TaskWatch
    from meshlearn.network.task.spec import Peer

    sent, clock = [], FakeClock()
    watch = TaskWatch(sent.append, clock=clock)
    p0, p1 = Peer(id="p0", address="127.0.0.1:1"), Peer(id="p1", address="127.0.0.1:2")

    def status(iteration, leader, state="training"):
        return RunStatus(task="t", index=0, state=state, leader=leader, results=False,
                         progress={"iteration": iteration, "iterations": 20, "train_loss": float("nan"),
                                   "test_acc": 0.5, "evaluated_at": 4})

    watch.update([(p0, status(4, "p0")), (p1, status(5, "p0"))])
    assert sent[-1]["providers"]["p0"] == {"state": "training", "iteration": 4, "iterations": 20, "train_loss": None,
                                           "test_acc": 0.5, "evaluated_at": 4, "leader": "p0"}
    watch.update([(p0, status(6, "p0"))])
    assert len(sent) == 1  # twice a second at most
    clock.advance(1)
    watch.lost("p1")
    watch.update([(p0, status(8, "p0"))])
    assert set(sent[-1]["providers"]) == {"p0", "p1"} and sent[-1]["providers"]["p1"]["state"] == "lost"
    assert sent[-1]["faults"] == ["provider p1 stopped answering"]
    clock.advance(1)
    watch.update([(p0, status(9, "p2"))])
    assert sent[-1]["faults"] == ["leader changed from p0 to p2"]
    watch.finish({"accuracy": 0.9})
    assert sent[-1]["result"] == {"accuracy": 0.9} and sent[-1]["faults"] == []
    board = TaskBoard()
    for body in sent:
        _report(board, "t", body)  # what the requester sends, the bootstrap takes
    assert board.view("t")["result"] == {"accuracy": 0.9} and len(board.view("t")["faults"]) == 2


def test_a_private_runs_page_shows_the_epsilon_spent_in_chromium(browser):
    """DP-SGD: each evaluation says the epsilon a node spent so far; the page shows the most of any node."""
    from meshlearn.config import make_config
    from meshlearn.sim.live import RunBoard

    board = RunBoard(make_config({"nodes": 3, "iterations": 10, "dp": "epsilon=8,delta=1e-5"}), "private")
    events = _flat_events(3, 10)
    for event in events:
        if event["event"] == "eval":
            event["epsilon"] = 0.5 * event["iteration"] + event["rank"]
    board.add(events)
    assert board.snapshot()["privacy"] == {"epsilon": 7.0, "delta": 1e-5}
    server = _served_board(board)
    try:
        browser.get(server.url)
        # read in one script call: the page redraws the element, and a handle found before a redraw is stale
        wait_until(lambda: "epsilon 7.00 spent at delta 0.00001" in _text(browser, ".privacy"), 10,
                   "the epsilon spent on the page")
    finally:
        server.stop()
