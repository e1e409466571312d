"""`sdbench site --out DIR` and gpu-check's folders: a rebuild replaces only the files an earlier build wrote; a
folder holding the user's files is refused before anything is read, and nothing of the user's is removed or
overwritten, whatever the rebuild drops."""

from __future__ import annotations

import json

import pytest

from sdbench.errors import SdbenchError
from sdbench.reporting.owned import MANIFEST, publish, staged
from tests.conftest import run_cli
from tests.site_data import run_rows, write_run


def _files(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_a_folder_of_the_users_is_refused_and_kept(tmp_path, capsys):
    results = tmp_path / "results"
    write_run(results, "run-a", run_rows("ngram", "cpu:m", 1.5))
    project = tmp_path / "myproject"
    (project / "data").mkdir(parents=True)
    (project / "runs").mkdir()
    (project / "data" / "important.txt").write_text("keep me")
    (project / "runs" / "exp1.log").write_text("and me")
    before = _files(project)
    code, out, err = run_cli(capsys, "site", str(results), "--out", str(project))
    assert code != 0 and "holds files sdbench did not write (data, runs)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert _files(project) == before and (project / "data" / "important.txt").read_text() == "keep me"
    # the results folder itself (a train-head's data/ shards beside the runs) is refused the same way
    (results / "data").mkdir()
    (results / "data" / "shard-0.pt").write_bytes(b"x")
    code, _, err = run_cli(capsys, "site", str(results), "--out", str(results))
    assert code != 0 and "holds files sdbench did not write" in err and (results / "data" / "shard-0.pt").is_file()
    # hidden entries (a publishing repository's .git) do not make a folder the user's
    (tmp_path / "pages" / ".git").mkdir(parents=True)
    assert run_cli(capsys, "site", str(results), "--out", str(tmp_path / "pages"))[0] == 0
    assert (tmp_path / "pages" / ".git").is_dir() and (tmp_path / "pages" / "runs" / "run-a.html").is_file()


def test_a_rebuild_removes_its_own_stale_pages_and_nothing_else(tmp_path, capsys):
    results, site = tmp_path / "results", tmp_path / "site"
    write_run(results, "run-a", run_rows("ngram", "cpu:m", 1.5))
    write_run(results, "run-b", run_rows("suffix", "cpu:m", 1.2))
    assert run_cli(capsys, "site", str(results), "--out", str(site))[0] == 0
    written = set(json.loads((site / MANIFEST).read_text())["files"])
    assert {"index.html", "runs/run-a.html", "runs/run-b.html", "data/runs/run-b.parquet"} <= written
    assert written == set(_files(site)) - {MANIFEST}  # the record names every file of the build, and only those
    (site / "notes.txt").write_text("mine")  # the user's files added to the site's folder
    (site / "data" / "mine.csv").write_text("a,b\n")
    (site / "runs" / "sub").mkdir()
    (site / "runs" / "sub" / "draft.md").write_text("mine too")
    (results / "run-b.parquet").unlink()
    assert run_cli(capsys, "site", str(results), "--out", str(site))[0] == 0
    assert not (site / "runs" / "run-b.html").exists() and not (site / "data" / "runs" / "run-b.parquet").exists()
    assert (site / "runs" / "run-a.html").is_file()
    assert (site / "notes.txt").read_text() == "mine" and (site / "data" / "mine.csv").read_text() == "a,b\n"
    assert (site / "runs" / "sub" / "draft.md").read_text() == "mine too"
    assert not [p for p in site.iterdir() if p.name.startswith(".sdbench-staging")]  # no staging left behind


def test_a_new_page_over_a_users_file_is_refused_and_the_old_site_stays(tmp_path, capsys):
    results, site = tmp_path / "results", tmp_path / "site"
    write_run(results, "run-a", run_rows("ngram", "cpu:m", 1.5))
    assert run_cli(capsys, "site", str(results), "--out", str(site))[0] == 0
    before = {name: (site / name).read_bytes() for name in _files(site)}
    (site / "runs" / "run-c.html").write_text("the user's page")
    write_run(results, "run-c", run_rows("draft", "cpu:m", 1.3))
    code, _, err = run_cli(capsys, "site", str(results), "--out", str(site))
    assert code != 0 and "runs/run-c.html is not a file an earlier build wrote" in err
    assert (site / "runs" / "run-c.html").read_text() == "the user's page"
    assert {name: (site / name).read_bytes() for name in before} == before  # nothing of the old site touched


def test_a_record_never_reaches_outside_its_folder(tmp_path):
    folder, outside = tmp_path / "site", tmp_path / "outside.txt"
    folder.mkdir()
    outside.write_text("not the site's")
    (folder / MANIFEST).write_text(json.dumps({"files": ["../outside.txt", str(outside), "gone.html"]}))
    (folder / "gone.html").write_text("old page")
    with staged(folder) as staging:
        (staging / "index.html").write_text("new")
        assert publish(staging, folder) == ["index.html"]
    assert outside.read_text() == "not the site's" and not (folder / "gone.html").exists()
    (folder / MANIFEST).write_text("not json")
    with staged(folder) as staging, pytest.raises(SdbenchError, match="not a list of files sdbench wrote"):
        publish(staging, folder)


def test_gpu_check_rewrites_only_its_own_files(tmp_path, monkeypatch):
    from sdbench.commands.gpucheck import page as gpage
    from sdbench.commands.reproduce.common import Figure

    folder = tmp_path / "part-2"
    folder.mkdir()
    (folder / "holiday.png").write_bytes(b"the user's picture")
    monkeypatch.setattr(gpage, "figures_of", lambda frame: [Figure("bench", "bench", b"\x89PNG")])
    gpage.write_part(folder, 2, [], {"device": "cpu"}, [])
    ours = set(json.loads((folder / MANIFEST).read_text())["files"])
    assert ours == {"part-2.parquet", "index.html", "bench.png"} and (folder / "bench.png").is_file()
    monkeypatch.setattr(gpage, "figures_of", lambda frame: [])
    gpage.write_part(folder, 2, [], {"device": "cpu"}, [])  # a later write with no figures drops its own PNG
    assert not (folder / "bench.png").exists() and (folder / "index.html").is_file()
    assert (folder / "holiday.png").read_bytes() == b"the user's picture"
    (tmp_path / "index.html").write_text("the user's index")
    with pytest.raises(SdbenchError, match="index.html is not a file an earlier build wrote"):
        gpage.merge(tmp_path)
    assert (tmp_path / "index.html").read_text() == "the user's index"
