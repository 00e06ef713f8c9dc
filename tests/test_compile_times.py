"""The suite-time tool (tests/compile_times.py): its summary adds the workers' reports and ranks by seconds."""

import json

import pytest

from compile_times import summarize


def test_summary_merges_workers_and_ranks_by_seconds(tmp_path):
    (tmp_path / "gw0.json").write_text(json.dumps({"tests/test_a.py::one": [3, 2.0, 5, 0.5],
                                                   "tests/test_b.py::two": [1, 9.0, 1, 0.0]}))
    (tmp_path / "gw1.json").write_text(json.dumps({"tests/test_a.py::three": [2, 4.0, 2, 1.0],
                                                   "<between tests>": [1, 0.5, 0, 0.0]}))
    (tmp_path / "gw2.json").write_text(json.dumps({"<between tests>": [1, 0.25, 0, 0.0]}))
    total, by_file, by_test = summarize(str(tmp_path)).split("\n\n")
    assert total == "8 backend compiles (16 s), 8 lowerings and traces (2 s)"
    rows = lambda section: [line.split() for line in section.splitlines()[1:]]  # noqa: E731
    # files: 9.0 s, then 2.5 + 5.0 = 7.5 s; the workers' rows of one key are added, not replaced
    assert rows(by_file) == [["1", "9.0", "tests/test_b.py"], ["5", "7.5", "tests/test_a.py"],
                             ["2", "0.8", "<between", "tests>"]]
    assert [r[-1] for r in rows(by_test)] == ["tests/test_b.py::two", "tests/test_a.py::three",
                                              "tests/test_a.py::one", "tests>"]


def test_summary_of_no_reports_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no reports"):
        summarize(str(tmp_path))
