"""docs/algorithms.md's supports table and README.md's list of algorithm names are the
registry's: written from it, checked here."""

from edgepfl.algorithms import ALGORITHMS
from edgepfl.registered import origin
from edgepfl.report import algorithm_table as at


def test_the_docs_table_is_the_registrys():
    text = at.DOC.read_text()
    assert at.with_table(text, at.supports_table()) == text, (
        "docs/algorithms.md's supports table differs from the registry: run "
        "python -m edgepfl.report.algorithm_table")


def test_the_readmes_list_of_names_is_the_registrys():
    text = at.README.read_text()
    assert at.with_table(text, at.name_list(), at.NAMES_BEGIN, at.NAMES_END) == text, (
        "README.md's list of algorithm names differs from the registry: run "
        "python -m edgepfl.report.algorithm_table")
    shipped = [n for n in ALGORITHMS if origin("algorithm", n) is None]
    listed = at.name_list()
    assert listed.startswith(f"{len(shipped)} algorithms: ")
    assert all(f"`{n}`" in listed for n in shipped)
    assert listed.index("`hierbayes`") > listed.index("through edge servers")


def test_the_table_reads_what_each_algorithm_declares():
    rows = {line.split("|")[1].strip(" `"): [c.strip() for c in line.split("|")[3:-1]]
            for line in at.supports_table().splitlines()[2:]}
    # a plug-in's algorithm, registered by a test before this one, is not edgepfl's
    assert set(rows) == {n for n in ALGORITHMS if origin("algorithm", n) is None}
    # tiers, edges, DP client, DP sample, batched, new clients
    assert rows["hierfavg"][1] == "yes" and rows["fedavg"][1] == "-"
    assert rows["fedavg"][0] == "yes" and rows["kapc"][0] == "-"
    assert rows["local"][5] == "-" and rows["fedavg"][5] == "yes"
    assert rows["fedavg"][4] == ("yes" if ALGORITHMS["fedavg"].client.batchable else "-")


def test_check_mode_says_when_the_file_drifted(tmp_path, monkeypatch, capsys):
    doc, readme = tmp_path / "algorithms.md", tmp_path / "README.md"
    doc.write_text(f"intro\n{at.BEGIN}\n| stale |\n{at.END}\nrest\n")
    readme.write_text(f"top\n{at.NAMES_BEGIN}\n`stale`\n{at.NAMES_END}\nend\n")
    monkeypatch.setattr(at, "DOC", doc)
    monkeypatch.setattr(at, "README", readme)
    assert at.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "algorithms.md" in err and "README.md" in err and "differs" in err
    assert at.main([]) == 0 and at.main(["--check"]) == 0
    assert doc.read_text().startswith("intro\n") and doc.read_text().endswith(f"{at.END}\nrest\n")
    assert "`fedavg`" in readme.read_text() and "`stale`" not in readme.read_text()


def test_a_plugins_algorithm_stays_out_of_the_docs_table(monkeypatch):
    from edgepfl import registered
    from edgepfl.algorithms.fedavg import ALGORITHM as FEDAVG

    fake = FEDAVG.__class__(**{**FEDAVG.__dict__, "name": "someones_method"})
    monkeypatch.setitem(ALGORITHMS, "someones_method", fake)
    monkeypatch.setitem(registered._origin, ("algorithm", "someones_method"), "their_plugin")
    assert "someones_method" not in at.supports_table()
