"""The suite-time tool (tests/compile_times.py): its summary adds the workers' reports and ranks by seconds."""

import json

import pytest

from compile_times import summarize


def test_summary_merges_workers_and_ranks_by_seconds(tmp_path):
    (tmp_path / "gw0.json").write_text(json.dumps({"tests/test_a.py::one": [3, 2.0, 5, 0.5],
                                                   "tests/test_b.py::two": [1, 9.0, 1, 0.0]}))
    (tmp_path / "gw1.json").write_text(json.dumps({"tests/test_a.py::three": [2, 4.0, 2, 1.0]}))
    lines = summarize(str(tmp_path)).splitlines()
    assert lines[0] == "6 backend compiles (15 s), 8 lowerings and traces (2 s)"
    files = [line.split()[-1] for line in lines[3:5]]
    assert files == ["tests/test_b.py", "tests/test_a.py"]  # 9.0 s before 2.5 + 5.0 = 7.5 s
    assert lines[3].split()[:2] == ["1", "9.0"] and lines[4].split()[:2] == ["5", "7.5"]
    tests = [line.split()[-1] for line in lines[7:]]
    assert tests == ["tests/test_b.py::two", "tests/test_a.py::three", "tests/test_a.py::one"]


def test_summary_of_no_reports_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no reports"):
        summarize(str(tmp_path))
