"""TOML syntax errors in a config file: each common mistake named in plain words, with its line
and column; anything else in tomllib's words, quoting the line."""

from __future__ import annotations

from pathlib import Path

from tests.test_config import issues_of


def test_toml_syntax_error_reports_its_line(tmp_path):
    issues = issues_of(tmp_path, "[engine]\nmax_steps = 4\nport 8000\n")
    assert list(issues) == ["<toml>"]
    assert issues["<toml>"].startswith("line 3, column ")
    # tomllib places some errors "at end of document"; they still get a line.
    assert issues_of(tmp_path, "[engine]\nmax_steps = [1,\n")["<toml>"].startswith("line 3, column 1: ")
    # Anything not explained in plain words keeps tomllib's words and quotes the line.
    assert issues["<toml>"].endswith("at `port 8000`")


def toml_error(tmp_path: Path, text: str) -> str:
    """The one message a file that is not valid TOML gets."""
    issues = issues_of(tmp_path, text)
    assert list(issues) == ["<toml>"]
    return issues["<toml>"]


def test_an_unclosed_table_header_is_named_as_such(tmp_path):
    # tomllib calls this "Cannot declare ('adaptive',) twice" when [adaptive] came before.
    text = '[adaptive]\nema_alpha = 0.2\n[engine]\nmax_k = 4\n[adaptive\nstrategy = "ema"\n'
    assert toml_error(tmp_path, text) == (
        'line 5, column 1: the table header "[adaptive" is not closed: write "[adaptive]"'
    )
    assert toml_error(tmp_path, "[[adaptive.slots]\nmin_batch_size = 1\n") == (
        'line 1, column 1: the table header "[[adaptive.slots]" is not closed: write "[[adaptive.slots]]"'
    )
    assert toml_error(tmp_path, "[adaptive  # the policy") == (
        'line 1, column 1: the table header "[adaptive" is not closed: write "[adaptive]"'
    )


def test_a_missing_closing_quote_points_at_the_opening_one(tmp_path):
    assert toml_error(tmp_path, '[adaptive]\nstrategy = "ema\nema_alpha = 0.2\n') == (
        'line 2, column 12: the string opened here is not closed: add the closing "'
    )
    # At the end of the file tomllib says "at end of document": the line is still found.
    assert toml_error(tmp_path, "[adaptive]\nstrategy = 'ema\n\n") == (
        "line 2, column 12: the string opened here is not closed: add the closing '"
    )


def test_a_key_set_twice_names_the_key_and_its_table(tmp_path):
    text = '[adaptive]\nema_alpha = 0.2\nstrategy = "ema"\nema_alpha = 0.3\n'
    assert toml_error(tmp_path, text) == 'line 4, column 1: "ema_alpha" is set twice in [adaptive] (first at line 2)'
    text = "[[adaptive.slots]]\nmin_batch_size = 1\nmin_batch_size = 2\n"
    assert toml_error(tmp_path, text) == (
        'line 3, column 1: "min_batch_size" is set twice in [[adaptive.slots]] (first at line 2)'
    )


def test_a_table_declared_twice_is_named(tmp_path):
    text = '[adaptive]\nema_alpha = 0.2\n\n[engine]\nmax_k = 4\n[adaptive]\nstrategy = "ema"\n'
    assert toml_error(tmp_path, text) == "line 6, column 1: the table [adaptive] is declared twice (first at line 1)"


def test_a_value_without_a_key_and_a_key_without_a_value(tmp_path):
    assert toml_error(tmp_path, "[engine]\n= 3\n") == (
        'line 2, column 1: "= 3" is a value without a key: write the key\'s name before "="'
    )
    expected = 'line 2, column 11: "strategy" has no value: write one after "="'
    assert toml_error(tmp_path, "[adaptive]\nstrategy =\nema_alpha = 0.2\n") == expected
    assert toml_error(tmp_path, "[adaptive]\nstrategy = # to choose\n") == expected
    assert toml_error(tmp_path, "[adaptive]\nstrategy =") == expected  # tomllib: "at end of document"


def test_an_unquoted_word_is_told_to_take_quotes(tmp_path):
    assert toml_error(tmp_path, "[adaptive]\nstrategy = ema\n") == (
        'line 2, column 12: the text ema needs quotes: write strategy = "ema"'
    )
