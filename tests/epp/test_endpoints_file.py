"""``epp.envoy.EndpointsFile``: the pool's endpoints as the EDS file Envoy watches, written whole
(a new file renamed over the old), from several writers at once, and an empty pool created only
where there is no file yet (Envoy's start must not blank the picker's pods)."""

from __future__ import annotations

import json
import threading

from epp.envoy import EndpointsFile


def hosts(path) -> set[str]:
    assignment = json.loads(path.read_text())["resources"][0]
    return {
        f"{e['endpoint']['address']['socket_address']['address']}:{e['endpoint']['address']['socket_address']['port_value']}"
        for group in assignment["endpoints"]
        for e in group["lb_endpoints"]
    }


def test_create_never_blanks_a_file_the_picker_wrote(tmp_path) -> None:
    path = tmp_path / "pool.json"
    assert EndpointsFile(path).write(["10.0.0.1:8000", "[fd00::1]:8000"])
    assert not EndpointsFile(path).create()
    assert hosts(path) == {"10.0.0.1:8000", "fd00::1:8000"}
    other = tmp_path / "empty.json"
    assert EndpointsFile(other).create()
    assert hosts(other) == set()


def test_writers_at_once_leave_a_whole_file(tmp_path) -> None:
    path = tmp_path / "pool.json"
    failures: list[BaseException] = []

    def write(n: int) -> None:
        try:
            for i in range(50):
                EndpointsFile(path).write([f"10.0.{n}.{i}:8000"])
        except BaseException as error:  # a writer's scratch file taken by another: the old bug
            failures.append(error)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert len(hosts(path)) == 1
    assert not list(tmp_path.glob(".pool.json.*"))  # no scratch file left behind


def test_unchanged_endpoints_are_not_written_again(tmp_path) -> None:
    path = tmp_path / "pool.json"
    endpoints = EndpointsFile(path)
    assert endpoints.write(["10.0.0.1:8000"])
    assert not endpoints.write(["10.0.0.1:8000"])
    assert endpoints.write([])
