"""The speed claims in README.md and the docs come from the results files
(``fa_sm100.results``): the committed files are in sync with their data, and a claim changes
when its data does."""

import json
import shutil

import pytest

from fa_sm100 import results


@pytest.mark.parametrize("name", results.FILES)
def test_committed_claims_match_their_results(name):
    text = (results.ROOT / name).read_text()
    assert results.CLAIM.search(text)
    assert results.render(text) == text, (
        f"{name}: its claims differ from the results files: run python -m fa_sm100 claims")


def test_a_claim_follows_its_data(tmp_path, monkeypatch):
    """Rewrite one varlen cell's ratio in a copy of the data: the rendered claim says so."""
    data = tmp_path / "docs" / "data" / "varlen"
    data.mkdir(parents=True)
    src = results.ROOT / "docs" / "data" / "varlen" / "varlen_h200.json"
    shutil.copy(src, data / "varlen_h200.json")
    before = results.CLAIMS["varlen"]()
    rows = json.loads(src.read_text())
    rows["rows"][0]["ratio"] = 0.5
    (data / "varlen_h200.json").write_text(json.dumps(rows))
    monkeypatch.setattr(results, "ROOT", tmp_path)
    after = results.CLAIMS["varlen"]()
    assert after != before and "0.500x" in after
    text = "speed: <!-- claim:varlen -->old<!-- /claim --> end"
    assert results.render(text) == f"speed: <!-- claim:varlen -->{after}<!-- /claim --> end"


def test_an_unknown_claim_is_an_error():
    with pytest.raises(ValueError, match="unknown claim"):
        results.render("<!-- claim:nope -->x<!-- /claim -->")
